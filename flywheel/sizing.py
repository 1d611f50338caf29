"""Memory each role needs from the model's parameter count N, and what the ``gpu`` overlay gives
it: one table, from which docs/deploy.md's "Devices and memory" table is generated
(:func:`markdown`) and to which tests/unit/test_gpu_overlay.py holds deploy/k8s/overlays/gpu (its
resources, its GPU node selection, and LoRA training where full fine-tuning does not fit).

Bytes per parameter follow from what the code loads, not from a rule of thumb:

* the trainer loads the model in float32 (trainer/policy.py), so full fine-tuning with AdamW holds
  weights (4), gradients (4) and the two moments (8), and the KL penalty's reference policy is
  another float32 copy (4): 20 × N. With LoRA the base is frozen and is the reference (the adapter
  switched off), so it is the float32 base alone, 4 × N; the adapter, its gradients and moments
  add well under 1% at the ranks vLLM serves;
* serving's vLLM engines hold the weights in bf16, 2 × N each: two engines (stable and canary)
  for full-weight versions, one engine with the versions as adapters with LoRA;
* the release gate holds stable and candidate at once in float32 (8 × N, adapters merged in
  float32: flywheel/adapters.py), and a full-weight version rebuilt from its delta chain is held
  once more in bf16 (2 × N);
* transformers loads a model through host memory: the trainer's float32 copy (4 × N), serving's
  bf16 one (2 × N).

What the table leaves out (activations, the CUDA context, the allocator's slack, the KV cache's
minimum) is kept as :data:`HEADROOM`: a role fits a device when its bytes are at most
``1 - HEADROOM`` of it. Torch-free, so the docs and the tests read it without a model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

GIB = 2**30
#: Share of a device left for what the table does not count (activations, CUDA context, slack).
HEADROOM = 0.25

Mode = Literal["full", "lora"]


@dataclass(frozen=True)
class Need:
    """What one role holds on one device, per parameter of the model, when training ``mode``."""

    role: str
    device: Literal["GPU", "host"]
    bytes_per_param: dict[Mode, float]
    what: str

    def gib(self, mode: Mode, params: float) -> float:
        return self.bytes_per_param[mode] * params / GIB

    def largest(self, mode: Mode, capacity_gib: float) -> float:
        """The most parameters that fit ``capacity_gib`` with the headroom kept."""
        return (1 - HEADROOM) * capacity_gib * GIB / self.bytes_per_param[mode]


NEEDS: tuple[Need, ...] = (
    Need("serving", "GPU", {"full": 4, "lora": 2},
         "weights in bf16 per engine: two engines (stable, canary) for full versions, one serving "
         "adapters with LoRA; the KV cache takes the rest of `serve.gpu_memory_utilization`"),
    Need("serving", "host", {"full": 2, "lora": 2}, "the bf16 weights, read through host memory while loading"),
    Need("trainer", "GPU", {"full": 20, "lora": 4},
         "full: fp32 weights, gradients, AdamW's two moments and the KL reference (4 + 4 + 8 + 4); "
         "LoRA: the frozen fp32 base, which is also the reference"),
    Need("trainer", "host", {"full": 4, "lora": 4}, "the fp32 model, loaded before it moves to the GPU"),
    Need("release controller", "host", {"full": 10, "lora": 8},
         "the gate's stable and candidate in fp32 (8), and a full version rebuilt from its delta in bf16 (2)"),
)


@dataclass(frozen=True)
class Overlay:
    """What deploy/k8s/overlays/gpu provides, and the model size it is stated for."""

    params: float
    gpu_min_mib: int
    """The least GPU memory its nodes have (GPU feature discovery's ``nvidia.com/gpu.memory``)."""
    mode: Mode
    host_gib: dict[str, int]
    """Each role's memory request and limit."""
    shm_gib: int
    """``/dev/shm`` of serving and the trainer, counted in their memory."""
    lora_rank: int

    @property
    def gpu_gib(self) -> float:
        return self.gpu_min_mib / 1024

    def capacity_gib(self, need: Need) -> float:
        """What the overlay gives ``need``: the GPU, or the pod's memory less its ``/dev/shm``
        (a memory-backed volume counts in the pod's memory)."""
        if need.device == "GPU":
            return self.gpu_gib
        return self.host_gib[need.role] - (self.shm_gib if need.role in ("serving", "trainer") else 0)

    def fits(self, need: Need, mode: Mode | None = None) -> bool:
        return need.gib(mode or self.mode, self.params) <= (1 - HEADROOM) * self.capacity_gib(need)


#: The gpu overlay: one 80 GB GPU each for serving and the trainer (A100 80GB reports 81,920 MiB,
#: H100 81,559: the overlay selects nodes with more than 79,999), for a model of up to 8B
#: parameters. Full fine-tuning of 8B needs 20 × 8B bytes = 149 GiB on the trainer's GPU, so the
#: overlay trains LoRA.
GPU_OVERLAY = Overlay(params=8e9, gpu_min_mib=80_000, mode="lora", lora_rank=16, shm_gib=4,
                      host_gib={"serving": 32, "trainer": 64, "release controller": 80})

#: The deployments the overlay's host sizes apply to, by role.
WORKLOADS = {"serving": "flywheel-serving", "trainer": "flywheel-trainer", "release controller": "flywheel-release"}


def _b(params: float) -> str:
    return f"{params / 1e9:.1f}B"


def markdown(overlay: Overlay = GPU_OVERLAY) -> str:
    """docs/deploy.md's table: each role's bytes per parameter, what they hold, what that is at the
    overlay's stated size, and the largest model that fits the overlay's device."""
    head = (f"| role | device | bytes × N, full fine-tuning | bytes × N, LoRA | what they hold "
            f"| at {_b(overlay.params)} ({overlay.mode}) | largest model, {overlay.mode}, on the `gpu` overlay "
            f"| largest model, full, on the `gpu` overlay |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- |\n")
    rows = []
    for n in NEEDS:
        capacity = overlay.capacity_gib(n)
        where = f"one {capacity:.0f} GiB GPU" if n.device == "GPU" else f"{capacity:.0f} GiB"
        rows.append(f"| {n.role} | {n.device} | {n.bytes_per_param['full']:g} | {n.bytes_per_param['lora']:g} "
                    f"| {n.what} | {n.gib(overlay.mode, overlay.params):.0f} GiB "
                    f"| {_b(n.largest(overlay.mode, capacity))} ({where}) "
                    f"| {_b(n.largest('full', capacity))} |")
    return head + "\n".join(rows) + "\n"
