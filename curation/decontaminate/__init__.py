"""The decontamination step: pool images that are views of eval images, verified on pixels."""
