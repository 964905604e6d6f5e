"""Small helpers every layer may use (layer 0: they import nothing from dinopipe or curation)."""
