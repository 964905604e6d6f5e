"""The object-store rows of the fault table (issue 48): a fault x a remote phase x the expected end.

Run by tests/faults/test_store_faults.py against moto's S3 server behind the fault proxy (tests/storage/_s3.py),
with a retry budget of ``BUDGET_S`` seconds (``DINOPIPE_STORAGE_RETRY_S``; the default is 300 s). A storm
"< budget" is a few failed requests the retries absorb; "> budget" lasts until the row ends. ``bound_s``: the
command ends within this many seconds of the fault (the budget included). Exit codes: 0 absorbed, 2 refused
(the user's to fix, at once), 75 unfinished (rerun the same command), 65 training that only skips.
"""

from __future__ import annotations

from tests.faults.table import Row

BUDGET_S = 1.5
EQUAL = "equal to the undisturbed run"
NOTHING = "nothing written or deleted"

_T, _C, _P = "store: training", "store: curation", "store: publish"
_E = "store: `dinopipe pretrain`"


def _rows(area: str, point: str, bound: float, cases: list[tuple[str, int, str]], rerun: str = EQUAL,
          slow: bool = False) -> list[Row]:
    return [Row(area, fault, point, code, bound, kept, rerun, slow) for fault, code, kept in cases]


ROWS = [
    *_rows(_T, "latest", 30, [
        ("503 storm < budget", 0, "the checkpoint found; " + NOTHING),
        ("503 storm > budget", 75, NOTHING),
        ("500 storm > budget", 75, NOTHING),
        ("connection reset", 0, "the checkpoint found; " + NOTHING),
        ("reset storm > budget", 75, NOTHING),
        ("cut body", 0, "the checkpoint found; " + NOTHING),
        ("403", 2, NOTHING),
        ("bad key", 2, NOTHING),
        ("expired token", 2, NOTHING),
        ("no such bucket", 2, NOTHING),
        ("absent (404)", 0, "no checkpoint: the run starts at step 0"),
    ]),
    *_rows(_E, "resume", 120, [
        ("SIGKILL at step 6, resumed in a 503 storm > budget", 75,
         "the bucket's checkpoints and `latest`, metrics.jsonl: unchanged"),
        ("`latest` lost after the run", 2, "nothing written; the message names both steps"),
    ], rerun=EQUAL + " (losses of every step)", slow=True),
    *_rows("training data", "training steps", 120, [
        ("every image unreadable", 65, "the run folder; the message names the shards"),
    ], rerun="65 again until the data is fixed", slow=True),
    *_rows(_T, "checkpoint save", 60, [
        ("503 storm < budget", 0, "the new checkpoint, `latest` names it"),
        ("503 storm > budget", 75, "`latest` and the previous checkpoint unchanged"),
        ("500 storm > budget", 75, "`latest` and the previous checkpoint unchanged"),
        ("connection reset", 0, "the new checkpoint, `latest` names it"),
        ("403", 2, "`latest` and the previous checkpoint unchanged"),
        ("an older run's later checkpoints", 0, "the newest step and the one just saved (pruned by step number)"),
    ]),
    *_rows(_T, "checkpoint load", 60, [
        ("503 storm < budget", 0, "the checkpoint's tensors"),
        ("503 storm > budget", 75, NOTHING),
        ("500 once", 0, "the checkpoint's tensors"),
        ("cut body", 0, "the checkpoint's tensors"),
        ("403", 2, NOTHING),
        ("deleted mid-run", 2, NOTHING + "; the message names the file"),
    ], rerun=EQUAL + " (after the file is restored)"),
    *_rows(_T, "pool walk", 30, [
        ("503 storm < budget", 0, "the pool index, no `#damaged` entry"),
        ("503 storm > budget", 75, "no pool index written"),
        ("reset storm > budget", 75, "no pool index written"),
        ("connection reset", 0, "the pool index, no `#damaged` entry"),
        ("cut body", 0, "the pool index, no `#damaged` entry"),
        ("truncated body", 0, "the pool index, no `#damaged` entry"),
        ("403", 2, "no pool index written"),
    ]),
    *_rows(_T, "pool listing", 30, [
        ("503 storm > budget", 75, "no pool index written"),
        ("no such bucket", 2, "no pool index written"),
    ]),
    *_rows(_T, "sample reads", 30, [
        ("503 storm < budget", 0, "every sample, none called corrupt"),
        ("503 storm > budget", 75, "no sample called corrupt"),
        ("500 once", 0, "every sample, none called corrupt"),
        ("connection reset", 0, "every sample, none called corrupt"),
        ("cut body", 0, "every sample, none called corrupt"),
        ("truncated body", 0, "every sample, none called corrupt"),
        ("403", 2, "no sample called corrupt"),
        ("expired token", 2, "no sample called corrupt"),
        ("deleted mid-run", 0, "the other objects' samples; its samples counted `missing`"),
        ("replaced mid-run", 0, "the other objects' samples; its samples counted `changed` (If-Match)"),
    ]),
    *_rows(_T, "sample reads (s3fs)", 30, [
        ("503 storm > budget", 75, "no sample called corrupt"),
        ("cut body", 0, "every sample, none called corrupt"),
        ("truncated body", 0, "every sample, none called corrupt"),
        ("403", 2, "no sample called corrupt"),
    ]),
    *_rows(_C, "curation listing", 30, [
        ("503 storm < budget", 0, "this task's ids"),
        ("503 storm > budget", 75, NOTHING),
        ("403", 2, NOTHING),
        ("cut body", 0, "this task's ids"),
    ]),
    *_rows(_C, "curation reads", 30, [
        ("503 storm < budget", 0, "every image's bytes"),
        ("503 storm > budget", 75, "no image called unreadable"),
        ("cut body", 0, "every image's bytes"),
        ("403", 2, "no image called unreadable"),
        ("deleted mid-run", 0, "the other images; the deleted one counted unreadable"),
    ]),
    *_rows("store: load", "dinopipe.load of an export", 30, [
        ("503 storm < budget", 0, "the export's weights"),
        ("503 storm > budget", 75, "nothing cached (no half-fetched folder)"),
        ("cut body", 0, "the export's weights"),
        ("403", 2, "nothing cached"),
    ]),
    *_rows("store: load", "dinopipe.load of a run folder (DCP)", 30, [
        ("503 storm > budget", 75, "nothing cached"),
        ("connection reset", 0, "the checkpoint's backbone"),
    ]),
    *_rows("store: load", "dinopipe export --model", 30, [
        ("503 storm > budget", 75, "no --out written"),
        ("bad key", 2, "no --out written"),
    ]),
    *_rows(_P, "publish", 30, [
        ("503 storm < budget", 0, "every file, then the marker"),
        ("503 storm > budget", 75, "no marker; the local output, for the rerun"),
        ("connection reset", 0, "every file, then the marker"),
        ("403", 2, "no marker; the local output"),
        ("an earlier publish's stale objects", 0, "this output's files only, then the marker"),
    ]),
    *_rows(_P, "pull", 30, [
        ("503 storm > budget", 75, "no scratch folder (no half-pulled folder)"),
        ("cut body", 0, "the whole published output"),
        ("no marker (half published)", 0, "nothing pulled: the steps start fresh"),
    ]),
]
