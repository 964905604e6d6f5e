"""The input normalisation every dinopipe backbone is trained and evaluated with (ImageNet statistics, as
DINOv2 / DINOv3). One home at the bottom layer: the augmentations, the eval transform, the exporters
(which write it into timm / HF preprocessor configs) and the curation embedder all read it here."""

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)



def in_channels(model) -> int:
    """Input channels of a backbone: a ViT's patch embedding, or a timm student's ``in_chans``."""
    pe = getattr(model, "patch_embed", None)
    return int(pe.proj.in_channels) if pe is not None else int(getattr(model, "in_chans", 3))


def input_norm(model) -> tuple[list[float], list[float]]:
    """(mean, std) a backbone expects its input normalised with, one value per input channel: what its
    training data recorded (``model.input_mean`` / ``input_std``, set from data.mean / data.std and kept in
    exports' config.json), else ImageNet's for RGB, else ImageNet's channel average in every channel (what
    the ``mean`` patch-embedding expansion of RGB weights assumes)."""
    n = in_channels(model)
    mean, std = getattr(model, "input_mean", None), getattr(model, "input_std", None)
    if mean is not None and std is not None and len(mean) == n == len(std):
        return [float(v) for v in mean], [float(v) for v in std]
    if n == 3:
        return list(IMAGENET_MEAN), list(IMAGENET_STD)
    return [sum(IMAGENET_MEAN) / 3] * n, [sum(IMAGENET_STD) / 3] * n


def set_input_norm(model, mean, std) -> None:
    """Record the per-channel statistics on the module (plain attributes: no weights, no state dict entry)."""
    if mean is not None and std is not None:
        model.input_mean, model.input_std = tuple(float(v) for v in mean), tuple(float(v) for v in std)


__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "in_channels", "input_norm", "set_input_norm"]
