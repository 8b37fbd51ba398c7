"""The planner's answer for one model: a dict (for --json), a rich table, and a plot."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from kvserve.errors import KVServeError
from kvserve.kv.formats import FORMATS
from kvserve.kv.policies import parse_policy

from kvserve.memory.planner import ALIASES, Device, capacity, kv_bytes, kv_bytes_per_token, kv_layout, mha_factor, roofline
from kvserve.memory.spec import ModelSpec

GiB = 2**30


@dataclass(slots=True)
class PlanRequest:
    dtypes: list[str] = field(default_factory=lambda: ["bf16", "fp8", "int8", "int4", "kivi2"])  # "K/V" plans them apart
    contexts: list[int] = field(default_factory=lambda: [4096, 32768, 131072])
    batches: list[int] = field(default_factory=lambda: [1, 8, 32])
    memory: int | None = None  # total device memory; None: the device's times num_devices
    num_devices: int = 1
    weight_bytes: int | None = None
    weight_bits: int = 16
    utilization: float = 0.9
    policies: list[str] = field(default_factory=list)  # KV policies (kvserve.kv.policies) to plan, on the first dtype


def plan(spec: ModelSpec, device: Device, req: PlanRequest) -> dict:
    checks = [(req.num_devices >= 1, f"num_devices must be >= 1, got {req.num_devices}"),
              (1 <= req.weight_bits <= 32, f"weight_bits must be in 1..32, got {req.weight_bits}"),
              (req.memory is None or req.memory > 0, f"memory must be > 0, got {req.memory}"),
              (0 < device.flops < math.inf and 0 < device.bandwidth < math.inf,
               f"a device needs finite FLOP/s and bandwidth > 0, got {device.flops:g} and {device.bandwidth:g}")]
    for ok, message in checks:
        if not ok:
            raise KVServeError(message)
    unsupported = {}  # dtypes this model's layout cannot take (kivi2 with sliding windows or MLA): left out, with why
    for name in req.dtypes:
        try:
            kv_layout(spec, name)
        except KVServeError as e:
            if name not in FORMATS and name not in ALIASES or len(unsupported) + 1 == len(req.dtypes):
                raise  # an unknown dtype, or nothing left to plan
            unsupported[name] = str(e)
    req = replace(req, dtypes=[n for n in req.dtypes if n not in unsupported])
    memory = device.memory * req.num_devices if req.memory is None else req.memory
    if req.num_devices > 1:  # tensor parallel: the roofline sees the devices' summed FLOP/s and bandwidth
        device = Device(f"{req.num_devices} x {device.name}", device.memory * req.num_devices,
                        device.flops * req.num_devices, device.bandwidth * req.num_devices)
    kv = {name: {"bytes_per_token": kv_bytes_per_token(spec, name),
                 "total_bytes": {c: {b: kv_bytes(spec, c, b, name) for b in req.batches} for c in req.contexts}}
          for name in req.dtypes}
    weight_bytes = req.weight_bytes if req.weight_bytes is not None else spec.weight_bytes
    cap = {name: capacity(spec, memory, req.contexts, name, weight_bytes, req.weight_bits, req.utilization)
           for name in req.dtypes}
    first = cap[req.dtypes[0]]
    policies = {}
    for text in req.policies:
        policy = parse_policy(text)
        layout = kv_layout(spec, req.dtypes[0], merge=policy if policy.merges_layers else None)
        held = {c: policy.held(c) for c in req.contexts}
        per_request = {c: layout.bytes_held(n) for c, n in held.items()}
        policies[str(layout.merge or policy)] = {"held_tokens": held, "bytes_per_request": per_request,
                                 "max_requests": {c: max(0, int(first.kv_budget // b)) for c, b in per_request.items()}}
    batch, context = req.batches[-1], req.contexts[0]
    prefill, decode = roofline(spec, batch, context, req.dtypes[0], req.weight_bits, weight_bytes)
    return {
        "model": {"name": spec.name, "attention": spec.attention_kind, "layers": spec.num_layers, "heads": spec.num_heads,
                  "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "kv_lora_rank": spec.kv_lora_rank,
                  "qk_rope_head_dim": spec.qk_rope_head_dim, "sliding_window": spec.sliding_window,
                  "local_layers": sum(spec.window_of(i) is not None for i in range(spec.num_layers)),
                  "params": spec.num_params(), "weight_source": "gguf" if spec.weight_bytes is not None else "parameters"},
        "mha_factor": mha_factor(spec),
        "unsupported_dtypes": unsupported,
        "kv": kv,
        "policies": policies,
        "capacity": {"memory_bytes": memory, "weight_bytes": first.weight_bytes, "utilization": req.utilization,
                     "kv_budget_bytes": {n: c.kv_budget for n, c in cap.items()},
                     "max_requests": {n: c.max_requests for n, c in cap.items()}},
        "roofline": {"device": device.name, "peak_flops": device.flops, "bandwidth": device.bandwidth,
                     "ridge_intensity": device.flops / device.bandwidth, "batch": batch, "context": context,
                     **{p.name: {"flops": p.flops, "bytes": p.bytes, "intensity": p.intensity, "bound": p.bound(device),
                                 "seconds": p.seconds(device)} for p in (prefill, decode)},
                     "decode_tokens_per_s_bound": batch / decode.seconds(device)},
    }


def render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console, m = Console(), report["model"]
    attention = m["attention"] + (f", {m['local_layers']}/{m['layers']} layers local (window {m['sliding_window']})"
                                  if m["local_layers"] else "")
    console.print(f"[bold]{m['name']}[/]: {m['layers']} layers, {attention}, {m['params'] / 1e9:.2f} B parameters; "
                  f"full MHA would cache {report['mha_factor']:.1f}x more")
    for name, why in report["unsupported_dtypes"].items():
        console.print(f"{name}: left out ({why})")
    kv = report["kv"]
    contexts = list(next(iter(kv.values()))["total_bytes"])
    table = Table(title="KV cache (scales included; kivi2 keeps the newest 128 tokens in 16-bit floats)")
    table.add_column("dtype")
    table.add_column("per token", justify="right")
    for c in contexts:
        table.add_column(f"{c:,} tok x batch {', '.join(map(str, kv[next(iter(kv))]['total_bytes'][c]))}", justify="right")
    for name, row in kv.items():
        cells = [" / ".join(f"{v / GiB:,.2f}" for v in row["total_bytes"][c].values()) + " GiB" for c in contexts]
        table.add_row(name, _per_token(row["bytes_per_token"]), *cells)
    console.print(table)
    cap = report["capacity"]
    table = Table(title=f"Capacity: {cap['memory_bytes'] / GiB:,.1f} GiB x {cap['utilization']:.0%}, weights "
                        f"{cap['weight_bytes'] / GiB:,.2f} GiB" + (" (the GGUF file's tensors as kvserve holds them)"
                                                                   if report["model"]["weight_source"] == "gguf" else ""))
    table.add_column("dtype")
    table.add_column("KV budget", justify="right")
    for c in contexts:
        table.add_column(f"max requests @ {c:,}", justify="right")
    for name, fits in cap["max_requests"].items():
        table.add_row(name, f"{cap['kv_budget_bytes'][name] / GiB:,.1f} GiB", *(f"{fits[c]:,}" for c in contexts))
    if report["policies"]:
        console.print(table)
        first = next(iter(kv))
        table = Table(title=f"KV policies ({first}): tokens kept, KV per request, max requests")
        table.add_column("policy", no_wrap=True)
        for c in contexts:
            table.add_column(f"@ {c:,}", justify="right")
        for name, row in report["policies"].items():
            table.add_row(name, *(f"{row['held_tokens'][c]:,} tok, {row['bytes_per_request'][c] / GiB:,.3f} GiB, "
                                  f"{row['max_requests'][c]:,}" for c in contexts))
    console.print(table)
    if min(cap["kv_budget_bytes"].values()) <= 0:
        console.print(f"[red]the weights ({cap['weight_bytes'] / GiB:,.1f} GiB) leave no room for the KV cache in "
                      f"{cap['utilization']:.0%} of {cap['memory_bytes'] / GiB:,.1f} GiB[/]")
    r = report["roofline"]
    table = Table(title=f"Roofline on {r['device']} (ridge {r['ridge_intensity']:.0f} FLOP/byte), "
                        f"batch {r['batch']}, context {r['context']:,}")
    for col in ("phase", "FLOPs", "bytes", "FLOP/byte", "bound", "time"):
        table.add_column(col, justify="right")
    for phase in ("prefill", "decode"):
        p = r[phase]
        table.add_row(phase, f"{p['flops']:.3g}", f"{p['bytes']:.3g}", f"{p['intensity']:,.1f}", p["bound"], f"{p['seconds'] * 1000:,.2f} ms")
    console.print(table)
    console.print(f"decode upper bound: {r['decode_tokens_per_s_bound']:,.0f} tokens/s at batch {r['batch']}")


def _per_token(value: float) -> str:
    return f"{value:,.0f} B ({value / 1024:,.1f} KiB)"


def plot(spec: ModelSpec, dtypes: list[str], max_context: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = [max(1, int(max_context * i / 64)) for i in range(65)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dtypes:
        ax.plot(contexts, [kv_bytes(spec, c, 1, name) / GiB for c in contexts], label=name)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV cache per request (GiB)")
    ax.set_title(f"{spec.name}: {spec.attention_kind}, {spec.num_layers} layers")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
