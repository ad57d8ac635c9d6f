"""The bottom layer: the types and facts every other layer shares (the view of a layer's prefill, tensor- and
pipeline-parallel facts, paths, device facts). It imports nothing of criticalkv above ``errors``, ``budget``,
``logits`` and ``models.families``."""
