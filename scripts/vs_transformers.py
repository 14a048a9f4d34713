#!/usr/bin/env python3
"""graphtrain against transformers on a Hugging Face Llama folder.

Builds small random `LlamaForCausalLM`s (grouped-query attention, untied and tied embeddings,
norm weights away from one, weights large enough that attention is far from uniform and a
wrong RoPE layout shows), saves each as transformers does (config.json, model.safetensors),
trains one step of it with `graphtrain run --config DIR --init DIR --dump-batches`, and compares
graphtrain's step-1 loss with transformers' loss on the same batch from the same weights. Then
the other way: a graphtrain model with Meta's interleaved RoPE, two steps trained from the
first folder's weights, `graphtrain export`ed and loaded by `LlamaForCausalLM.from_pretrained`,
against graphtrain's own loss on the next step.

    PYTHON scripts/vs_transformers.py [GRAPHTRAIN_BINARY]

PYTHON needs torch, numpy and transformers (the PyTorch peer's venv plus `pip install
transformers`). Prints one line per model and exits 1 where the two differ by more than 1e-5.
"""
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

binary = sys.argv[1] if len(sys.argv) > 1 else "target/release/graphtrain"
worst = 0.0
with tempfile.TemporaryDirectory() as tmp:
    for tied in (False, True):
        cfg = LlamaConfig(hidden_size=64, intermediate_size=160, num_attention_heads=4,
                          num_key_value_heads=2, num_hidden_layers=2, vocab_size=300,
                          max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                          tie_word_embeddings=tied, initializer_range=0.25)
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).float().eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
        folder = os.path.join(tmp, f"llama-tied-{tied}")
        model.save_pretrained(folder, safe_serialization=True)
        batches, metrics = os.path.join(tmp, "b.u32"), os.path.join(tmp, "m.jsonl")
        subprocess.run([binary, "run", "--config", folder, "--init", folder, "--batch", "2",
                        "--steps", "1", "--data", "random", "--dump-batches", batches,
                        "--metrics", metrics], check=True, capture_output=True)
        ours = [json.loads(l)["loss"] for l in open(metrics) if '"kind":"step"' in l][0]
        rows = np.fromfile(batches, dtype="<u4").astype(np.int64).reshape(2, -1)
        x, y = torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])
        with torch.no_grad():
            logits = model(input_ids=x).logits
        theirs = torch.nn.functional.cross_entropy(
            logits.reshape(-1, cfg.vocab_size).double(), y.reshape(-1)).item()
        rel = abs(ours - theirs) / theirs
        worst = max(worst, rel)
        print(f"tied embeddings {tied}: graphtrain {ours:.7f}, transformers {theirs:.7f}, "
              f"relative difference {rel:.1e}")
    # Export: an interleaved-RoPE graphtrain model (q and k rows reordered on the way out).
    folder = os.path.join(tmp, "llama-tied-False")
    ron = subprocess.run([binary, "config", "show", folder], check=True, capture_output=True,
                         text=True).stdout
    config = os.path.join(tmp, "interleaved.ron")
    with open(config, "w") as f:
        f.write(ron.replace("rope_layout: Half", "rope_layout: Interleaved")
                   .replace("batch: 8", "batch: 2"))
    common = [binary, "run", "--config", config, "--init", folder, "--data", "fixed"]
    metrics, ckpt = os.path.join(tmp, "m3.jsonl"), os.path.join(tmp, "c.ckpt")
    batches, exported = os.path.join(tmp, "b3.u32"), os.path.join(tmp, "exported")
    subprocess.run(common + ["--steps", "3", "--metrics", metrics], check=True,
                   capture_output=True)
    ours = [json.loads(l)["loss"] for l in open(metrics) if '"kind":"step"' in l][2]
    subprocess.run(common + ["--steps", "2", "--checkpoint", ckpt, "--dump-batches", batches],
                   check=True, capture_output=True)
    subprocess.run([binary, "export", ckpt, "--out", exported], check=True, capture_output=True)
    model = LlamaForCausalLM.from_pretrained(exported).float().eval()
    rows = np.fromfile(batches, dtype="<u4").astype(np.int64).reshape(2, 2, -1)[0]  # step 1 of 2
    x, y = torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:])
    with torch.no_grad():
        logits = model(input_ids=x).logits
    theirs = torch.nn.functional.cross_entropy(
        logits.reshape(-1, model.config.vocab_size).double(), y.reshape(-1)).item()
    rel = abs(ours - theirs) / theirs
    worst = max(worst, rel)
    print(f"exported (interleaved RoPE, step 3): graphtrain {ours:.7f}, transformers "
          f"{theirs:.7f}, relative difference {rel:.1e}")
sys.exit(0 if worst <= 1e-5 else 1)
