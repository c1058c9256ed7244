"""Corpus capture output formats that other tools read: SAELens' activation cache (``saelens``) and
delphi's latent cache (``delphi``), each written with pyarrow / safetensors alone."""
