"""Every level the release controller tests at: the budget across canaries for PASS, and the
looks the guardrails are judged at within a canary. Pure functions, table-tested in
tests/unit/test_release_budget.py; the bench (bench/canary_stats.py) reads the levels from here,
so what it shows is what the controller uses.

**Across canaries** (:func:`canary_alpha`, :func:`pass_level`). Each canary's PASS test holds its
error at its own level, but a deployment runs canary after canary, and at a fixed level each one
is another chance of a false promotion. The canaries are counted in blocks of
``release.budget_canaries`` (B, in the order they started), and the j-th canary of a block is
tested for PASS at e-LOND's level ``alpha * gamma_j * (R + 1)``, R the passes among the canaries of
its block before it (Xu and Ramdas, "Online multiple testing with e-values", 2024), with

    gamma_j = 1 / (2 B)  +  (B + 1) / (2 B j (j + 1)),   j = 1 .. B  (summing to 1).

Half the block's budget is spread evenly (every canary keeps a level of at least
``alpha / (2 B)``), half front-loaded as before (the first canary of a block gets most). What it
guarantees, within each block: the expected share of promotions that were no better than stable
(the false discovery rate, FDR) is at most alpha, and the expected number of them at most
``alpha * (1 + promotions in the block)``; when no canary of a block was better, the chance that
any of them was promoted (FWER) is at most alpha. It is **not** a bound over a deployment's whole
life: over n blocks the expected false promotions are at most alpha per block. No rule can hold
the whole-life chance under alpha and keep promotions possible: with no better canary among them,
a rule whose k-th level did not shrink towards 0 would promote one of infinitely many by chance
for certain. Blocks are the price of a lift staying promotable at the 50th canary
(release/README.md has the measured power). FAIL is not budgeted: it is tested at alpha per
canary, since a wrong rollback sends users back to the version they had.

**Guardrails within a canary** (:func:`look_due`, :func:`guardrail_level`). The rate guardrails
are judged per user at pre-planned looks: when each arm has 20, 40, 80, ... users (doubling:
``FIRST_LOOK_USERS * 2 ** (n - 1)`` for look n). Look n spends ``guardrail_alpha / (n (n + 1))``
of the guardrails' budget, split evenly over the checks judged there, so by the union bound the
chance that two identical versions are ever rolled back by one of them is at most
``release.guardrail_alpha``, however long the canary runs (the sums of 1/(n (n + 1)) over looks
and of 1/checks over checks are 1). The looks are fixed by user counts, which do not depend on
what users said, and each is taken once.
"""

from __future__ import annotations

from collections.abc import Sequence


def gamma(j: int, block: int) -> float:
    """The share of a block's budget its ``j``-th canary (from 1) gets (module docstring)."""
    if not 1 <= j <= block:
        raise ValueError(f"canary {j} of a block of {block}")
    return 1 / (2 * block) + (block + 1) / (2 * block * j * (j + 1))


def canary_alpha(alpha: float, k: int, passes: int, block: int) -> float:
    """The level the ``k``-th canary of a deployment (from 1) is tested at for PASS, after
    ``passes`` PASS verdicts among the canaries of its block before it (module docstring)."""
    j = (k - 1) % block + 1 if k >= 1 else 0
    if not 0 <= passes < max(j, 1):
        raise ValueError(f"{passes} passes before canary {k} in a block of {block}: "
                         "a count of this deployment's canaries is wrong")
    return alpha * gamma(j, block) * (passes + 1)


def pass_level(alpha: float, block: int, before: Sequence[bool]) -> float:
    """The level of the next canary, given whether each canary before it passed, in the order they
    started (the release database's audit log: ``ReleaseStore.canary_passes``)."""
    k = len(before) + 1
    start = (k - 1) // block * block  # the first canary of k's block, from 0
    return canary_alpha(alpha, k, sum(before[start:]), block)


#: Users each arm has when the guardrails are first judged; the next looks come at each doubling.
#: Below about 20 users a per-user comparison rests on a handful of people, and its normal
#: approximation (even with Student's t) is loose.
FIRST_LOOK_USERS = 20


def look_due(users: int, taken: int) -> int:
    """The look to take now, when the smaller arm has ``users`` users and ``taken`` looks were
    taken before (0: none is due). Looks skipped between two ticks are not taken: a look not
    taken spends nothing."""
    reached = (max(users, 0) // FIRST_LOOK_USERS).bit_length()  # 20-39 users: 1, 40-79: 2, ...
    return reached if reached > taken else 0


def guardrail_level(guardrail_alpha: float, look: int, checks: int) -> float:
    """The one-sided level each of ``checks`` guardrails is tested at on look ``look`` (from 1)."""
    if look < 1 or checks < 1:
        raise ValueError(f"look {look} of {checks} checks")
    return guardrail_alpha / (look * (look + 1) * checks)
