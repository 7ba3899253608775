"""What the exporter and the runtime share, and the only package both import: errors, the graph I/O contract,
the engine-directory format and its checks, the tokenizer files, the verification rule and its randomness,
prompt files, and the command lines' plumbing. It imports neither of them."""
