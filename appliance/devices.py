"""The OpenVINO devices on this machine: `appliance devices`, and the start-up check that a requested one exists.

A box is installed once and then runs unattended, so the first thing an operator asks is what it can run on:
`appliance devices` lists each device OpenVINO finds (CPU, GPU.0, NPU) with its name, its optimization
capabilities and the facts that decide our defaults (the CPU's vector extensions: AVX-512-bf16 or AMX make bf16
the CPU's default inference precision). `serve --device GPU` on a box without one fails before anything starts,
with one line naming the devices that are present (ov.Core().available_devices: 0.2 s here, cheaper than a
failed model load, which would also print a traceback). Missing plugins (no OpenCL for the GPU plugin, no NPU
driver) are simply absent from available_devices.

OpenVINO is imported inside the functions: the CLI loads this module for every command."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from appliance import cpu_isa
from appliance.settings import ConfigError

# Device properties worth showing when the plugin has them (each device type answers a different set).
EXTRA_PROPERTIES = ("DEVICE_ARCHITECTURE", "INFERENCE_PRECISION_HINT", "GPU_DEVICE_TOTAL_MEM_SIZE", "DEVICE_GOPS")
VIRTUAL = ("AUTO", "HETERO", "MULTI", "BATCH")  # meta-devices: what they name is checked instead


def available() -> list[str]:
    import openvino as ov

    return list(ov.Core().available_devices)


def describe() -> list[dict[str, Any]]:
    """One record per device: id, name, capabilities, and the extra properties the plugin reports."""
    import openvino as ov

    core, rows = ov.Core(), []
    for device in core.available_devices:
        supported = set(core.get_property(device, "SUPPORTED_PROPERTIES"))
        row: dict[str, Any] = {
            "device": device,
            "name": str(core.get_property(device, "FULL_DEVICE_NAME")),
            "capabilities": [str(c) for c in core.get_property(device, "OPTIMIZATION_CAPABILITIES")],
        }
        for prop in EXTRA_PROPERTIES:
            if prop in supported:
                try:
                    value = core.get_property(device, prop)
                except RuntimeError:  # listed but not readable on this driver
                    continue
                row[prop.lower()] = value.to_string() if isinstance(value, ov.Type) else str(value)
        if device.startswith("CPU"):
            isa = cpu_isa.detect()
            row["isa"] = list(isa.flags)
            row["isa_level"] = isa.name  # what the served default export is chosen by (appliance/paths.py)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The devices as a plain-text table: device, name, capabilities, then the other facts as key=value."""
    lines = [("DEVICE", "NAME", "CAPABILITIES", "DETAILS")]
    for row in rows:
        details = " ".join(
            f"{k}={','.join(v) if isinstance(v, list) else v}"
            for k, v in row.items()
            if k not in ("device", "name", "capabilities")
        )
        lines.append((row["device"], row["name"], ",".join(row["capabilities"]), details))
    widths = [max(len(line[i]) for line in lines) for i in range(3)]
    return (
        "\n".join(
            "  ".join(cell.ljust(w) for cell, w in zip(line[:3], widths)) + "  " + line[3] for line in lines
        ).rstrip()
        + "\n"
    )


def missing(device: str, present: Iterable[str]) -> list[str]:
    """The physical devices `device` names (CPU, GPU.1, AUTO:GPU,CPU, HETERO:NPU,CPU) that are not present."""
    present = [d.upper() for d in present]
    wanted = device.split(":", 1)[1] if ":" in device else device
    absent = []
    for name in wanted.replace("(", ",").replace(")", "").split(","):
        name = name.strip().upper()
        if not name or name in VIRTUAL:
            continue
        # GPU matches GPU.0; GPU.1 must be present as such
        if not any(d == name or ("." not in name and d.split(".")[0] == name) for d in present):
            absent.append(name)
    return absent


def require(devices: Iterable[str]) -> None:
    """`serve`'s check before anything starts: ConfigError, one line naming what is present, when a device is not
    (appliance/cli.py's `main` makes it exit 78)."""
    present = available()
    absent = [name for device in devices for name in missing(device, present)]
    if absent:
        raise ConfigError(
            f"device {', '.join(dict.fromkeys(absent))} is not present on this machine; "
            f"present: {', '.join(present) or 'none'} (see `appliance devices`)"
        )


def main(as_json: bool) -> int:
    """`appliance devices [--json]`."""
    rows = describe()
    print(json.dumps(rows, indent=2) if as_json else table(rows), end="\n" if as_json else "")
    return 0
