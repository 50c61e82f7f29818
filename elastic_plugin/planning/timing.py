"""An estimated step time from a stated model (not a measurement):

* compute: each stage's FLOPs per micro-batch / (TP x CP) at ``efficiency`` x the device's dense peak
  (BF16; FP32 runs on TF32 tensor cores at half of it; FP8 GEMMs at the FP8 peak);
* TP and EP collectives sit on the critical path (not overlapped) and take
  ``bytes x bus factor / (link bandwidth x comm_efficiency)``; bus factors as nccl-tests:
  all-reduce ``2 (n - 1) / n``, all-gather / reduce-scatter / all-to-all ``(n - 1) / n``, p2p 1.
  A group uses NVLink when its ranks fit one NVLink domain (Megatron orders ranks TP, CP, EP,
  DP, PP from the inside), the network otherwise; CP's collectives are on the critical path too;
* the 1F1B schedule runs ``m + p - 1`` slots of the slowest stage for ``m`` micro-batches on
  ``p`` stages (the bubble is ``(p - 1) / (m + p - 1)`` of it), a slot being one micro-batch's
  teacher forward and student forward + backward (the teacher runs inside the student's
  schedule); p2p sends add per micro-batch;
* the gradient reduction over DP is not overlapped (``overlap_grad_reduce=False``), and the
  optimizer step reads and writes every state byte once at HBM bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_plugin.planning.devices import Device

__all__ = ["StepTime", "bus_factor", "group_bandwidth", "step_time"]


def bus_factor(kind: str, n: int) -> float:
    """Bytes on the wire per byte of message for a collective over ``n`` ranks (ring)."""
    if kind == "p2p":
        return 1.0
    if n < 2:
        return 0.0
    share = (n - 1) / n
    return 2 * share if kind == "all_reduce" else share


def group_bandwidth(device: Device, span: int) -> float:
    """Bytes/s per GPU for a group whose ranks span ``span`` consecutive ranks."""
    gbps = device.nvlink_gbps if span <= device.nvlink_domain else device.network_gbps
    return gbps * 1e9


@dataclass(frozen=True)
class StepTime:
    seconds: float
    compute: float
    tp_ep_comm: float
    pp_comm: float
    dp_comm: float
    optimizer: float
    bubble_fraction: float

    def to_dict(self) -> dict[str, float]:
        return {
            "seconds": self.seconds,
            "compute": self.compute,
            "tp_ep_comm": self.tp_ep_comm,
            "pp_comm": self.pp_comm,
            "dp_comm": self.dp_comm,
            "optimizer": self.optimizer,
            "bubble_fraction": self.bubble_fraction,
        }


def step_time(
    device: Device,
    tp: int,
    pp: int,
    ep: int,
    dp: int,
    student_stage_flops: list[int],
    teacher_stage_flops: list[int],
    comm: dict[str, dict[str, float]],
    num_microbatches: int,
    state_bytes: float,
    peak_tflops: float,
    efficiency: float,
    comm_efficiency: float,
    cp: int = 1,
) -> StepTime:
    """Step time of one rank of the slowest stage. ``*_stage_flops``: one micro-batch per
    stage (whole model, divided by TP x CP here); ``comm``: ``comm.step_comm_bytes`` of the
    busiest stage; ``state_bytes``: weights + gradients + optimizer state of a rank; ``dp``
    without ``cp`` (the gradients' group is DP x CP)."""
    rate = peak_tflops * 1e12 * efficiency
    dp = dp * cp
    sizes = {"tp": (tp, tp), "tp_ep": (tp * ep, tp * ep), "ep": (ep, tp * ep),
             "cp": (cp, tp * cp), "pp": (pp, tp * dp * pp), "dp": (dp, tp * dp),
             "edp": (dp // ep, tp * dp), "tp_dp": (tp * dp, tp * dp)}  # fmt: skip  # group -> (ranks, span)

    def seconds(groups: tuple[str, ...]) -> float:
        total = 0.0
        for group in groups:
            n, span = sizes[group]
            bw = group_bandwidth(device, span) * comm_efficiency
            for kind, nbytes in comm.get(group, {}).items():
                total += nbytes * bus_factor(kind, n) / bw
        return total

    m = num_microbatches
    slots = m + pp - 1
    stage = max(
        (s + t) / (tp * cp) / rate for s, t in zip(student_stage_flops, teacher_stage_flops)
    )  # one micro-batch of teacher forward + student forward/backward on the slowest stage
    compute = slots * stage
    tp_ep = seconds(("tp", "tp_ep", "ep", "cp")) * slots / m
    pp_comm = seconds(("pp",)) * slots / m
    dp_comm = seconds(("dp", "edp", "tp_dp"))
    optimizer = 2 * state_bytes / (device.hbm_tbps * 1e12)
    total = compute + tp_ep + pp_comm + dp_comm + optimizer
    return StepTime(total, compute, tp_ep, pp_comm, dp_comm, optimizer, (pp - 1) / slots)
