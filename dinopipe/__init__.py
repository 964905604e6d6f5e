"""dinopipe: curate images, pretrain a ViT the DINOv2 way, distill it, and load the result anywhere."""

__version__ = "0.1.0"

from .models import create_model, list_models  # noqa: E402


def load(*args, **kwargs):
    """Load a backbone from a dinopipe run/export, an official DINOv2 ``.pth`` or a timm state dict.

    See :func:`dinopipe.hub.load`.
    """
    from .hub import load as _load

    return _load(*args, **kwargs)


__all__ = ["create_model", "list_models", "load", "__version__"]
