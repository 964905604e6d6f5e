"""The GPU estimate's tables in docs/gpu.md and README.md, generated from bench/gpu_proxy.py's JSON (never typed):
``python bench/gpu_proxy.py --render`` (``make gpu-proxy`` runs it after the bench). Each table goes between its
markers (``<!-- begin: NAME -->`` ... ``<!-- end: NAME -->``, bench/tools/render_tables.py's ``replace_region``); the
output depends only on the JSON files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.tools.render_tables import replace_region  # noqa: E402
from dinopipe.plan.gpu_cost import CATEGORIES  # noqa: E402

DOC = REPO / "docs" / "gpu.md"
README = REPO / "README.md"
BEFORE = REPO / "bench" / "results" / "gpu_proxy_before.json"
TITLES = {"vit_s14_b64": "ViT-S/14 b=64", "vit_l14_b32": "ViT-L/14 b=32"}


def _names(report: dict) -> list[str]:
    """The cases in TITLES' order, then any other."""
    return sorted(report["cases"], key=lambda n: (list(TITLES).index(n) if n in TITLES else len(TITLES), n))


def _cell(c: dict) -> str:
    return f"{c['ms']:.2f} / {c['kernels']:,} / {c['gb']:.1f}"


def category_table(name: str, after: dict, before: dict | None) -> str:
    """H200 datasheet, per category: ms / kernels / GB of dinopipe before, after and the official step."""
    a = after["cases"][name]
    b = before["cases"].get(name) if before else None
    head = ["category (H200 roofline: ms / kernels / GB)"] + (["dinopipe before"] if b else []) + [
        "dinopipe now", "official"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cat in CATEGORIES:
        if cat not in a["official"]["H200"]["categories"] or not any(
                x[s]["H200"]["categories"].get(cat, {}).get("kernels") for x in (a, b) if x for s in x
                if s in ("dinopipe", "official")):
            continue  # a category neither step launches (fused / extern: compiled steps only)
        cells = ([_cell(b["dinopipe"]["H200"]["categories"][cat])] if b else []) + [
            _cell(a["dinopipe"]["H200"]["categories"][cat]), _cell(a["official"]["H200"]["categories"][cat])]
        rows.append(f"| {cat} | " + " | ".join(cells) + " |")
    tot = ([_cell(b["dinopipe"]["H200"]["total"])] if b else []) + [
        _cell(a["dinopipe"]["H200"]["total"]), _cell(a["official"]["H200"]["total"])]
    rows.append("| **step** | " + " | ".join(f"**{t}**" for t in tot) + " |")
    gf = ([b["dinopipe"]["H200"]["total"]["gflop"]] if b else []) + [
        a["dinopipe"]["H200"]["total"]["gflop"], a["official"]["H200"]["total"]["gflop"]]
    rows.append("| GFLOP (GEMM + attention) | " + " | ".join(f"{g:,.0f}" for g in gf) + " |")
    return "\n".join(rows)


def measured_table(report: dict) -> str:
    """The same-GPU pairs timed so far (bench/gpu_proxy.py's MEASURED), dinopipe beside the official step."""
    pairs: dict = {}
    for m in report.get("measured", []):
        pairs.setdefault((m["gpu"], m["model"], m["b"]), {})[m["code"]] = m
    rows = ["| measured (card, date) | case | images/s, dinopipe / official | dinopipe / official | how |",
            "|---|---|---|---|---|"]
    for (gpu, model, b), p in pairs.items():
        d, o = p["dinopipe"], p["official"]
        name = TITLES.get(f"{model}_b{b}", f"{model} b={b}")
        rows.append(f"| {gpu}, {d['note'].split(',')[0]} | {name} | {d['images_per_s']:.0f} / {o['images_per_s']:.0f} | "
                    f"**{d['images_per_s'] / o['images_per_s']:.2f}** | dinopipe: {d['note'].split(', ', 1)[1]}; "
                    f"official: {o['note'].split(', ', 1)[1]} |")
    return "\n".join(rows)


def ratio_table(after: dict, before: dict | None) -> str:
    """Per case and GPU datasheet: the estimated speed ratio dinopipe / official (roofline), kernels, bytes, MFU."""
    rows = ["| case | GPU (datasheet) | estimated speed ratio (roofline) | kernels, dinopipe / official | "
            "bytes, dinopipe / official | MFU (roofline), dinopipe / official |", "|---|---|---|---|---|---|"]
    for name in _names(after):
        c = after["cases"][name]
        for g in ("H100", "H200", "A100"):
            d, o, r = c["dinopipe"][g]["total"], c["official"][g]["total"], c["ratio"][g]
            prev = ""
            if before and name in before["cases"]:
                prev = f" (before: {before['cases'][name]['ratio'][g]['roofline']:.2f})"
            rows.append(f"| {TITLES.get(name, name)} | {g} | {r['roofline']:.2f}{prev} | "
                        f"{d['kernels']:,} / {o['kernels']:,} ({r['kernels']:.2f}) | {d['gb']:.0f} / {o['gb']:.0f} GB "
                        f"({r['bytes']:.2f}) | {d['mfu']:.1%} / {o['mfu']:.1%} |")
    return "\n".join(rows)


def doc_section(after: dict, before: dict | None) -> str:
    parts = ["Measured first (same GPU, same run):", "", measured_table(after), "",
             f"Estimated (roofline; {after.get('conditions', 'eager, one rank')}):", "", ratio_table(after, before), ""]
    for name in _names(after):
        parts += [f"**{TITLES.get(name, name)}**, per category:", "", category_table(name, after, before), ""]
    return "\n".join(parts).rstrip()


def readme_table(after: dict) -> str:
    rows = [measured_table(after), "",
            "Estimated on a CPU (H200 / H100 datasheet roofline, eager, one rank: dinopipe without FSDP, the official "
            "FSDP1 without xformers):", "",
            "| case | estimated speed, H200 | H100 | kernels | bytes |", "|---|---|---|---|---|"]
    for name in _names(after):
        h2, h1 = after["cases"][name]["ratio"]["H200"], after["cases"][name]["ratio"]["H100"]
        rows.append(f"| {TITLES.get(name, name)} | {h2['roofline']:.2f} | {h1['roofline']:.2f} | {h2['kernels']:.2f}× | "
                    f"{h2['bytes']:.2f}× |")
    return "\n".join(rows)


def render(path: Path, doc: Path = DOC, readme: Path = README, before: Path = BEFORE) -> int:
    if not path.is_file():
        print(f"error: no {path}: run `make gpu-proxy` (bench/gpu_proxy.py) first", file=sys.stderr)
        return 2
    after = json.loads(path.read_text())
    prev = json.loads(before.read_text()) if before.is_file() and before.resolve() != path.resolve() else None
    for page, name, content in ((doc, "gpu-proxy", doc_section(after, prev)),
                                (readme, "readme-gpu-proxy", readme_table(after))):
        text = page.read_text()
        page.write_text(replace_region(text, name, content))
        print(f"wrote {name} into {page.relative_to(REPO) if page.is_relative_to(REPO) else page}")
    return 0
