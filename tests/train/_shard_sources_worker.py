"""Loads each source under the meta-build recorder, shards it (FSDP2), replays it, and saves this rank's shards
and how many rows it read of each lazily read tensor (``test_shard_sources.py``).

    torchrun --nproc_per_node=2 tests/train/_shard_sources_worker.py OUT NAME=PATH ...
"""

import sys
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dinopipe
from dinopipe.train.dist import destroy, init_distributed
from dinopipe.train.meta_init import InitRecorder
from dinopipe.utils import lazy_rows, safe_dcp
from dinopipe.utils import torch_compat as compat

safe_dcp.LAZY_MIN_BYTES = 1  # every DCP tensor but a scalar is read lazily here (default: 1 MiB and larger)


def main(out: str, *sources: str) -> None:
    info = init_distributed("cpu")
    reads: dict[int, list] = {}
    full = [0]
    rows, whole = lazy_rows.LazyRows.rows, lazy_rows.LazyRows.full

    def counted_rows(self, start, stop):
        entry = reads.setdefault(id(self._read), [0, self.shape[0]])
        entry[0] += max(0, min(stop, self.shape[0]) - max(start, 0))
        return rows(self, start, stop)

    def counted_full(self):
        full[0] += 1
        return whole(self)

    lazy_rows.LazyRows.rows, lazy_rows.LazyRows.full = counted_rows, counted_full
    for name, path in (s.split("=", 1) for s in sources):
        reads.clear()
        full[0] = 0
        rec = InitRecorder()
        with rec.recording():
            model = dinopipe.load(path)
        rec.bind(model)
        why = rec.unreplayable()
        lazy = sum(isinstance(getattr(r, "tensor", None), lazy_rows.LazyRows) for st in rec.storages.values()
                   for e in st.entries for r in tree_flatten(e.args)[0])  # file tensors the build copied from
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)
        model.to_empty(device="cpu")
        rec.materialize(model)
        shards = {}
        for k, t in model.state_dict().items():
            if isinstance(t, DTensor):
                shape, offset = compat.local_shape_and_global_offset(t)
                shards[k] = (t.to_local().clone(), list(offset))
            else:
                shards[k] = (t.clone(), [0] * t.dim())
        torch.save({"shards": shards, "rows_read": {str(k): tuple(v) for k, v in reads.items()},
                    "full_reads": full[0], "lazy_tensors": lazy, "unreplayable": why},
                   Path(out) / f"{name}.rank{info.rank}.pt")
    destroy()


if __name__ == "__main__":
    main(*sys.argv[1:])
