"""The configs of DeepEP's normal mode (intranode): how many SMs its dispatch and combine
kernels take, and their NVLink chunk sizes.

DeepEP's kernels move tokens at a rate that grows with the SMs they run on. Its library
default is 20 (``deep_ep.Buffer.num_sms``) and its own intranode test runs 24. Measured
on 2 H200s (2026-11-29, bf16, H=7168, K=8, E=256, the tokens format's round trip, layout
and notify included), per step:

    SMs                       20    24    32    40    48    64    96
    4096 tokens per rank, us  986   810   676   590   544   528   495
    128 tokens per rank, us   97.9  90.1  80.8  81.3  80.5  78.3  77.8

`NUM_SMS` (48) takes most of that gain and leaves the other SMs (84 of an H200's 132) to
compute that runs beside the transfer (shared experts, another chunk's experts).
`set_num_sms` changes it for the communicators opened after it. Each communicator's NVLink
buffer grows with the SMs (one receive queue of 256 tokens per two SMs and peer: at H=7168,
about 0.2 GB at 2 ranks and 0.8 GB at 8 with 48 SMs, 0.08 and 0.34 GB with 20). The chunk
sizes are DeepEP's own defaults for the world size (``Buffer.get_dispatch_config`` and
``get_combine_config``): tuned at 48 SMs they gained 1.5%, within run-to-run spread.
"""

from __future__ import annotations

NUM_SMS = 48

# DeepEP's intranode defaults by world size: NVLink send chunk of dispatch and of combine;
# then the fields every one of them shares (NVLink receive buffer in tokens, RDMA send and
# receive chunks, which intranode kernels do not use).
_SEND_CHUNKS = {2: (24, 10), 4: (6, 9), 8: (6, 4)}
SHARED_FIELDS = (256, 6, 128)


def set_num_sms(num_sms: int) -> None:
    """The SMs DeepEP's normal-mode kernels take in the communicators opened from now on
    (an even count; DeepEP runs one channel per two SMs). Communicators already open keep
    theirs: `torch_moe_ops.backends.deepep.close_all()` (on every rank) closes them."""
    global NUM_SMS
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 2 or num_sms % 2:
        raise ValueError(f"num_sms must be an even int >= 2 (DeepEP runs one channel per two "
                         f"SMs), got {num_sms!r}")
    NUM_SMS = num_sms


def normal_configs(deep_ep, ep_size: int, device_sms: int | None = None) -> tuple:
    """``(dispatch_config, combine_config)`` of normal mode for ``ep_size`` ranks of one
    host (2, 4 or 8), on `NUM_SMS` SMs, which must be below ``device_sms`` (the GPU's SM
    count, where known): DeepEP's channels wait for each other, so its kernels must all be
    resident at once, beside at least one SM of other work."""
    if ep_size not in _SEND_CHUNKS:
        raise ValueError(f"DeepEP's normal mode runs on 2, 4 or 8 ranks of one host, got "
                         f"{ep_size}")
    if device_sms is not None and NUM_SMS >= device_sms:
        raise ValueError(f"num_sms must be below the GPU's {device_sms} SMs (set_num_sms), "
                         f"got {NUM_SMS}")
    return tuple(deep_ep.Config(NUM_SMS, chunk, *SHARED_FIELDS)
                 for chunk in _SEND_CHUNKS[ep_size])
