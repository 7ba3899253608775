"""Drafters on one training framework: DSpark (Markov/RNN + confidence heads), DFlash, EAGLE-3-style."""
