"""A decision's ``text`` as Slack (mrkdwn) and Mattermost (Markdown) show it: what a person
wrote, never a ping, a disguised link or a line of its own (release/decisions.py ``chat_text``)."""

from __future__ import annotations

import pytest

from release.decisions import chat_text

J = "\u2060"  # word joiner


@pytest.mark.parametrize(("text", "shown"), [
    ("v3 rejected by abe: wrong tone", "v3 rejected by abe: wrong tone"),
    # Slack control sequences: channel pings, a user, a link labelled as anything
    ("<!channel> look", "&lt;!channel&gt; look"),
    ("<!here|here> and <@U024BE7LH>", f"&lt;!here|here&gt; and &lt;@{J}U024BE7LH&gt;"),
    ("approve at <https://evil.example|the console>", "approve at &lt;https://evil.example|the console&gt;"),
    # an & is escaped first, so an entity written out stays as written
    ("a &lt; b & c", "a &amp;lt; b &amp; c"),
    # Mattermost mentions and Markdown links
    ("@channel @here @all @abe", f"@{J}channel @{J}here @{J}all @{J}abe"),
    ("(@channel)", f"(@{J}channel)"),
    ("mail ops@example.com", "mail ops@example.com"),  # not a mention
    ("[approve](https://evil.example)", f"[approve]{J}(https://evil.example)"),
    ("![x](https://evil.example/i.png)", f"![x]{J}(https://evil.example/i.png)"),
    # one line: no fake message below
    ("ok\nv9 promoted to stable by admin", "ok v9 promoted to stable by admin"),
    ("a\r\n\tb\u2028c\u2029d\x00e\x85f", "a b c d e f"),
])
def test_chat_text(text, shown):
    assert chat_text(text) == shown
