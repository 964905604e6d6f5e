"""The text report of ``dinopipe plan`` (:func:`dinopipe.plan.plan` computes the figures; this lays them out)."""

from __future__ import annotations

GiB = 1024**3


def _gb(x: float) -> str:
    return f"{x / GiB:.2f}"


def format_report(r: dict) -> str:
    pc, st = r["params"], r["state"]
    heads = ", ".join(f"{k} {v / 1e6:.1f}M" for k, v in pc.items() if k.endswith("_head"))
    lines = [
        f"dinopipe plan: {r['model']} on {r['gpus']} GPU(s) x {r['gpu_mem_gb']:g} GiB, compute {r['compute_dtype']}"
        f"{', FSDP2 full sharding' if r['gpus'] > 1 else ' (no FSDP on one GPU)'}",
        f"parameters: backbone {pc['backbone'] / 1e6:.1f}M, {heads}; student {pc['student'] / 1e6:.1f}M"
        f" + EMA teacher {pc['teacher'] / 1e6:.1f}M",
        "",
        "model state per GPU (GiB)",
        f"  student params {_gb(st['student_params'])}  grads {_gb(st['student_grads'])}  "
        f"AdamW {_gb(st['optimizer'])}  teacher {_gb(st['teacher_params'])}  "
        f"unsharded units {_gb(st['unsharded_units'])}"
        + (f"  Gram teacher {_gb(st['gram_teacher_params'])}" if "gram_teacher_params" in st else "")
        + f"  = {_gb(st['total'])}",
        f"  + {r['margin']:.0%} fragmentation margin on everything, + {r['overhead_gb']:g} GiB CUDA context/NCCL",
        "",
    ]
    if r.get("comm"):
        c = r["comm"]
        lines[-1:-1] = [f"communication per step and rank (FSDP2): all-gather {_gb(c['all_gather'])} GiB "
                        f"({r['compute_dtype']}) + reduce-scatter {_gb(c['reduce_scatter'])} GiB (backbone "
                        f"{r['reduce_dtypes'][0]}, heads {r['reduce_dtypes'][1]}) = {c['ratio']:.3f} of all-fp32"]
    if r.get("gram"):
        lines[-1:-1] = [r["gram"]]
    for ph in r["phases"]:
        lines.append(f"phase {ph['name']}: {ph['steps']} steps, {ph['batch_per_gpu']} img/GPU (global "
                     f"{ph['global_batch']}), crops {ph['global_crops_size']} px ({ph['tokens'][0]} tokens)"
                     + (f" + {ph['local_crops_size']} px ({ph['tokens'][1]} tokens)" if len(ph["tokens"]) > 1 else ""))
        lines.append(f"  {'attention, AC':18s} {'act/img GiB':>11s} {'peak act GiB':>12s} {'total GiB':>10s} "
                     f"{'fits':>5s} {'max img/GPU':>11s}")
        configured = f"{r['attention']}_{'ac' if r['activation_checkpointing'] else 'noac'}"
        for key, m in ph["memory"].items():
            attn, ac = key.split("_")
            fits = m["total"] <= r["gpu_mem_gb"] * GiB
            lines.append(f"  {attn + (', AC' if ac == 'ac' else ', no AC'):18s} {m['per_image'] / GiB:11.3f} "
                         f"{_gb(m['peak']):>12s} {_gb(m['total']):>10s} {'yes' if fits else 'NO':>5s} "
                         f"{m['max_batch']:11d}" + ("  <- config" if key == configured else ""))
        f = ph["flops"]
        cf = ph["crop_forward_flops"]
        lines.append(f"  FLOPs/step/GPU: student fwd+bwd {f['student'] / 1e12:.2f} T + teacher fwd "
                     f"{f['teacher'] / 1e12:.2f} T" + (f" + Gram teacher {f['gram'] / 1e12:.2f} T" if f.get("gram") else "")
                     + f" = {f['model'] / 1e12:.2f} TFLOP (with AC recompute "
                     f"{f['hardware_ac'] / 1e12:.2f}); forward per crop {cf['global'] / 1e9:.1f} G global, "
                     f"{cf['local'] / 1e9:.1f} G local")
        if "step_seconds" in ph:
            lines.append(f"  at {r['gpu_tflops']:g} TFLOPS x MFU {r['mfu']:.0%}: {ph['step_seconds']:.3f} s/step, "
                         f"{ph['hours']:.1f} h, {ph['gpu_hours']:.0f} GPU-hours")
        lines.append("")
    lines.append(f"total: {r['total_steps']} steps, {r['total_flops']:.3g} FLOPs"
                 + (f", {r['hours']:.1f} h wall, {r['gpu_hours']:.0f} GPU-hours" if "gpu_hours" in r else
                    " (give --gpu-tflops for time)"))
    return "\n".join(lines)


__all__ = ["format_report"]
