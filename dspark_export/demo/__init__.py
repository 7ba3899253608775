"""The bundled demo target: offline corpus, BPE tokenizer, a small Qwen3 trained on CPU, prompt sets.

`python -m dspark_export.demo.build` rebuilds all of it with fixed seeds.
"""
