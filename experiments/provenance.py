"""What every result carries beside its numbers: command, library versions, machine, time."""

from __future__ import annotations

import datetime as dt
import os
import platform
import sys

from env.machine import library_versions  # noqa: F401  (re-exported: what every result's provenance names)


def machine() -> dict[str, object]:
    import torch

    from env.machine import cpu_label, machine_info

    info: dict[str, object] = {
        "cpu_label": cpu_label(),  # model, family/model and the bf16 flags: what every figure names
        "platform": platform.platform(),
        "processor": str(machine_info()["cpu"]),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    from kernels.packed import packed_decided
    from kernels.quant import wide_setting

    info["wide_products_in_fp32"] = wide_setting()  # per activation dtype, as probed (kernels.quant)
    # fp32 products through oneDNN with reordered weights (kernels.packed; None: not decided in this process)
    info["fp32_products_reordered"] = packed_decided()
    from env.allocator import allocator_state

    info.update(allocator_state())  # freed memory kept or not (env.allocator; "untouched": no target loaded)
    return info


def provenance() -> dict[str, object]:
    return {
        "command": " ".join(["draftgym", *sys.argv[1:]]),
        "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "versions": library_versions(),
        "machine": machine(),
    }
