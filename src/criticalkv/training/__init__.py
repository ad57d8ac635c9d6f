"""Fitting learned pieces to a model: the surrogate of the reconstruction scorer (``criticalkv train-scorer``)."""
