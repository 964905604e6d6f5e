"""dinopipe: curate images, pretrain a ViT the DINOv2 way, distill it, and load the result anywhere."""

import os as _os

# OpenMP threads that spin while waiting make torch 10-20x slower on CPU as soon as another busy process
# (a DataLoader worker, a second rank, a test runner) shares the cores. Passive waiting costs nothing
# measurable when the machine is idle. Only effective if torch was not imported before dinopipe.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"



def __getattr__(name):
    # create_model / list_models load torch and the model registry on first use, not on `import dinopipe`:
    # the array-only curation steps import dinopipe.utils and would otherwise carry torch (+420 MB per task).
    if name in ("create_model", "list_models"):
        from . import models

        return getattr(models, name)
    raise AttributeError(f"module 'dinopipe' has no attribute {name!r}")


def load(*args, **kwargs):
    """Load a backbone from a dinopipe run/export, an official DINOv2 ``.pth`` or a timm state dict.

    See :func:`dinopipe.hub.load`.
    """
    from .hub import load as _load

    return _load(*args, **kwargs)


__all__ = ["create_model", "list_models", "load", "__version__"]
