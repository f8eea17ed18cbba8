"""The model card (ds4tools/data/demo/README.md), generated from the run's metrics."""
from __future__ import annotations


def _fmt_list(values, digits=3) -> str:
    return " ".join("–" if v is None else f"{v:.{digits}f}" for v in values)


def _tau_table(ev: dict) -> str:
    rows = [
        ("held-out files, real text (anchors every few tokens)", "heldout_text"),
        ("target's own greedy generations from the held-out prompts", "generated_greedy"),
        ("target's own T=1 generations from the held-out prompts", "generated_t1"),
    ]
    out = [
        "| context | anchors | DSpark τ (no cut) | DSpark τ (conf cut 0.5) | mean proposal at cut | prompt-lookup τ |",
        "|---|---|---|---|---|---|",
    ]
    for label, key in rows:
        r = ev[key]
        out.append(
            f"| {label} | {r['dspark']['n']} | **{r['dspark']['tau']:.3f}** ± {r['dspark']['tau_stderr']:.3f} "
            f"| {r['dspark_conf_cut_0.5']['tau']:.3f} | {r['mean_proposal_len_conf_cut_0.5']:.2f} "
            f"| {r['prompt_lookup']['tau']:.3f} ± {r['prompt_lookup']['tau_stderr']:.3f} |")
    out.append("")
    out.append("Acceptance per position (k = 1..8), P(accepted ≥ k) and, in brackets, the conditional "
               "acceptance P(accepted ≥ k | accepted ≥ k−1):")
    out.append("")
    out.append("| context | drafter | P(acc ≥ k) | conditional |")
    out.append("|---|---|---|---|")
    for label, key in rows:
        for name, sub in (("DSpark", "dspark"), ("DSpark, cut 0.5", "dspark_conf_cut_0.5"),
                          ("prompt lookup", "prompt_lookup")):
            r = ev[key][sub]
            out.append(f"| {key} | {name} | {_fmt_list(r['p_accepted_at_least'])} "
                       f"| ({_fmt_list(r['conditional_acceptance'])}) |")
    return "\n".join(out)


def _shortfall(m: dict) -> str:
    """Why a goal was missed, from this run's own figures (the card must not guess)."""
    tgt, ev = m["target"], m["eval"]
    curve = ", ".join(f"{s}: {loss:.2f}" for s, loss in tgt["heldout_loss_history"])
    return f"""
**Where the shortfall comes from.** The stdlib corpus is small for the step budget: the target saw its
{m['tokenizer']['train_tokens']:,} train tokens {tgt['epochs']:.1f} times and ends at
{tgt['train_windows_loss_fp32_weights']:.2f} nats/token on train windows against
{ev['target_heldout_loss']:.2f} on held-out files; the held-out loss barely moved after step 3000
({curve}). Where the target is sure, its drafters agree with it: DSpark τ is
{ev['generated_greedy']['dspark']['tau']:.2f} on the target's own greedy generations against {ho_tau(ev):.2f}
on held-out text; MTP agrees {ev['generated_greedy']['mtp_agreement_two_ahead']:.2f} along greedy generations
against {ev['mtp_heldout']['agreement_with_target_two_ahead']:.2f} on held-out text. Tried for the draft
(short runs, docs/distill.md's recipe trials): windows and blocks per step, learning rates, the
target's self-generated text, its greedy rollouts as labels; kept: 16 windows × 24 blocks a step and
LR 6e-3. What would move it: a larger corpus than one Python's stdlib (the issue fixes the corpus), or
a longer DSpark run (those trials gained about 0.1 τ per doubling of the step count).
"""


def ho_tau(ev: dict) -> float:
    return ev["heldout_text"]["dspark"]["tau"]


def _dspark_training(m: dict) -> str:
    """The DSpark draft's training bullets, from its ``ds4tools distill`` report (metrics "dspark")."""
    ds, c, dsh = m["dspark"], m["corpus"], m["draft_shape"]
    n = m["target_shape"]["num_hidden_layers"]
    o, r, d, ee = ds["options"], ds["resolved"], ds["data"], ds["engine_evaluation"]
    layers = dsh["target_layer_ids"]
    accept = " ".join(f"{a:.2f}" for a in ds["final_ema"]["accept"])
    h = ee["heldout"]
    pr = ee.get("prompts")
    prompts = ""
    if pr:
        same = "identical to" if pr["greedy_identical_to_plain"] else "NOT identical to"
        prompts = (f"; speculative decoding of the {pr['prompts']} prompts × {pr['tokens_per_prompt']} tokens: "
                   f"greedy τ {pr['greedy']['draft']['tau']:.3f} (prompt lookup {pr['greedy']['lookup']['tau']:.3f}), "
                   f"output {same} plain decoding; T=1 τ {pr['t1']['draft']['tau']:.3f} "
                   f"({pr['t1']['lookup']['tau']:.3f})")
    empty = c["file_count"] - d["files"]
    files = (f"the {c['file_count']} less {empty} empty ones" if empty > 0 and d["bytes_read"] == c["total_bytes"]
             else f"{d['bytes_read']:,} bytes")
    if o.get("time_s"):
        steps = (f"{ds['steps']} steps: {ds['train_s'] / 60:.1f} min of training on {o['threads']} threads of an "
                 f"idle machine after {d['features_seconds'] / 60:.1f} min of features (`--time` fixed the step "
                 f"count from its first steps; `tools/train_demo.py` passes it as `--steps {ds['steps']}`, "
                 "which gives the same schedule and batches)")
    else:
        steps = (f"{ds['steps']} steps (`tools/train_demo.py` runs the command with `--steps {ds['steps']}` in "
                 f"place of `--time 30m`): {ds['train_s'] / 60:.1f} min of training on {o['threads']} threads "
                 f"after {d['features_seconds'] / 60:.1f} min of features")
    check = ds.get("llama_server_check")
    if check:
        on = f", on {check['draft_file']}" if check.get("draft_file") else ""
        server = (f"It runs in llama.cpp's server (`{check['command']}`): greedy text identical with and "
                  f"without the draft on {check['identical']}/{check['prompts']} prompts checked "
                  f"(`{check['tool']}`{on}).")
    else:
        server = ("`tools/llama_server_check.py` runs it in llama.cpp's server (`llama-server -m target.gguf "
                  "-md dspark.gguf --spec-type draft-dspark`) and compares the greedy text with the server's "
                  "without it.")
    prev = ds.get("previous_draft")
    previous = ""
    if prev:
        previous = (f"\n- It replaces the previous bundled draft ({prev['trained_by']}), which read target layers "
                    f"{prev['target_layer_ids']}, the last of them the target's output, so that llama.cpp could "
                    f"not run it; by the protocol below it measured held-out τ {prev['heldout_tau']:.3f}.")
    return f"""- **DSpark draft**: trained by `ds4tools distill` (docs/distill.md) on the engine's own features
  of the target as ds4tools ships it (`target/` converted to a Q8_0 GGUF, `ds4tools.demo.demo_model_path`):
  one engine forward per training window gives the raw outputs of target layers {layers} and the
  final hidden state, whose softmax through the target's head is what the draft learns; embedding and
  lm_head are the target's (from that GGUF), frozen. The command (docs/distill.md, "The 30-minute
  runs"; `STD` the stdlib path above, `DEMO` that GGUF):

  ```bash
  {ds['command'].replace(chr(10), chr(10) + '  ')}
  ```

  Data: {d['files']} files of the same corpus ({files}), the same held-out split
  ({d['heldout_files']} files, never trained on); {d['text_windows']} random train windows of {d['seq_len']}
  tokens, no self-generated text, no rollouts. Each step takes {r['batch_windows']} windows and
  {r['blocks_per_window']} random text anchors of each: block `[x_a, <|mask|> × {dsh['block_size'] - 1}]`
  learns the window's next tokens and the target's distributions along the window. Loss (DeepSpec):
  {ds['loss']}; Markov input teacher-forced on the window's tokens; {r['optimizer']}, peak LR
  {o['lr']:g}, {r['warmup_steps']} warm-up steps, then cosine to 5%; {o['precision']} autocast; seed {o['seed']}.
  Initialised from the target: the layers from its last {dsh['num_draft_layers']}, `fc` passing the last
  feature (layer {layers[-1]}) through, the final norm its own, Markov W2 and the confidence head at
  zero. {steps}; {ds['parameters_trainable']:,} trainable parameters. Final training EMA of the per-slot
  acceptance (1 − TV, teacher-forced): {accept}. distill's own measure (the engine, Q8_0 target and
  draft): held-out τ {h['dspark']['tau']:.3f} at block {h['block']} over {h['dspark']['n']:,} anchors
  (conf cut 0.5: {h['dspark_conf_cut_0.5']['tau']:.3f}; prompt lookup {h['prompt_lookup']['tau']:.3f}){prompts}.
- **Target layers {layers}**, not the last ({n - 1}): llama.cpp's qwen3 and llama graphs expose to a
  draft only the inputs of layers 0..{n - 1} (the raw outputs of layers -1..{n - 2}), and abort on a draft
  that asks for the last layer's output (`GGML_ASSERT(t_layer_inp[il] != nullptr && "layer input tensor
  is null")`); distill's default, three layers spread from 1 to n-2, is {layers} here
  (`dflash.target_layers` {", ".join(str(i + 1) for i in layers)} in the GGUF). `ds4tools inspect DRAFT.gguf
  --target TARGET.gguf` checks that. {server}{previous}"""


def make_card(m: dict) -> str:
    c, tk, tg, mtp, ds, ev = m["corpus"], m["tokenizer"], m["target"], m["mtp"], m["dspark"], m["eval"]
    dsh = m["draft_shape"]
    layers = dsh["target_layer_ids"]
    sizes, plan, times = m["sizes"], m["plan"], m["timings"]
    bench = m.get("step_times_uncontended")
    tgt_cfg = m["target_shape"]
    ho = ev["heldout_text"]
    ok_tau = ho["dspark"]["tau"] >= 2.5 and ho["dspark"]["tau"] > ho["prompt_lookup"]["tau"]
    ok_mtp = ev["mtp_heldout"]["agreement_with_target_two_ahead"] >= 0.5
    bench_lines = ""
    if bench:
        bench_lines = "\n".join(
            f"| {k} | {v['seconds_per_step']:.3f} s | {v['cpu_seconds_per_step']:.3f} s | {v['threads']} "
            f"| {v['load_average']:.1f} | {v['what']} |" for k, v in bench.items())
        est = times.get("estimated_uncontended_s")
        bench_lines = ("\nPer-step time measured once by `python tools/train_demo.py --bench` (best of 5; the "
                       "load average says how idle the machine was; CPU seconds hardly depend on it):\n\n"
                       "| stage | wall s/step | CPU s/step | threads | load | step |\n|---|---|---|---|---|---|\n"
                       + bench_lines + "\n")
        if est:
            bench_lines += (f"\nEstimated uncontended total: **{est / 60:.0f} min** (these per-step times × the "
                            "step counts, plus corpus preparation, the DSpark stage's `ds4tools distill` run and "
                            "evaluation as measured in this run).\n")
    return f"""# ds4tools demo model: a small Qwen3 target with an MTP layer and a DSpark draft

Trained from scratch on CPU by `tools/train_demo.py` (PyTorch, the `train` extra) on the Python
{c['python_version']} standard library. It exists so that ds4tools' engine, GGUF writers and
speculative-decoding tests have a real, self-consistent target + MTP + DSpark triple that fits in a
wheel. It is a toy language model of Python source; do not expect it to write useful code.

| directory | what | tensors | parameters | bytes |
|---|---|---|---|---|
| `target/` | `Qwen3ForCausalLM` + one NextN/MTP layer (`num_nextn_predict_layers: 1`), f16 | {sizes['target_tensors']} | {sizes['target_params']:,} (trunk {tg['parameters_trunk']:,}, MTP {mtp['parameters']:,}) | {sizes['target_bytes']:,} |
| `dspark/` | DeepSpec `Qwen3DSparkModel` draft trained by `ds4tools distill`, f16 (embedding and lm_head are the target's, not stored) | {sizes['dspark_tensors']} | {sizes['dspark_params']:,} | {sizes['dspark_bytes']:,} |
| `target/tokenizer.json` | byte-level BPE, vocab {tk['vocab_size']} | | | {sizes['tokenizer_bytes']:,} |
| everything in `ds4tools/data/demo` | | | | {sizes['total_bytes']:,} (limit 12 MB) |

Also here: `heldout_files.txt` (the held-out split, relative stdlib paths), `prompts.json`
({m['n_prompts']} prompts from held-out files: a `def` line plus the start of its body), `metrics.json`
(every figure on this page, the loss curves and the run plan) and `reference.json` (fp32 outputs of
these weights on four prompts, for re-implementations).

## Data

- Corpus: every `*.py` under the standard library of CPython {c['python_version']}
  (`sysconfig` stdlib path), sorted, without directories named {', '.join('`' + d + '`' for d in c['excluded_dirs'])}:
  **{c['file_count']} files, {c['total_bytes']:,} bytes**; SHA-256 of the newline-joined file list
  `{c['file_list_sha256']}`.
- Split: {c['split_rule']}: **{c['heldout_count']} held-out files** ({c['heldout_bytes']:,} bytes,
  {tk['heldout_tokens']:,} tokens), listed in `heldout_files.txt`; nothing of them is used in training.
- Tokenizer: `tokenizers` byte-level BPE trained on the train split, vocab {tk['vocab_size']} with the
  specials `<|endoftext|>` (id 0, also appended after every file) and `<|mask|>` (id 1, DSpark's mask
  token); GPT-2 pre-tokenization (`ByteLevel(add_prefix_space=False)`, its regex). Train split:
  {tk['train_tokens']:,} tokens ({tk['train_tokens_per_byte']:.4f} tokens/byte); held-out
  {tk['heldout_tokens_per_byte']:.4f} tokens/byte.

## Architecture (the contract the numba engine implements)

Notation: H = {tgt_cfg['hidden_size']}, V = {tgt_cfg['vocab_size']}, head_dim d = {tgt_cfg['head_dim']},
{tgt_cfg['num_attention_heads']} query heads sharing {tgt_cfg['num_key_value_heads']} KV head, FFN
{tgt_cfg['intermediate_size']}, eps = {tgt_cfg['rms_norm_eps']:g}. `W x` below means `x @ W.T` with the
stored torch `[out, in]` weight. E = `model.embed_tokens.weight` [V, H]; `lm_head.weight` [V, H]
(untied).

- **RMSNorm** with weight w: `y = x / sqrt(mean(x²) + eps) * w`, in fp32, over the last axis.
- **RoPE** (rotate-half / "neox", theta {tgt_cfg['rope_theta']:g}) at position p on a d-vector:
  for j < d/2, `f_j = theta^(-2j/d)`, `(x_j, x_(j+d/2)) -> (x_j cos(p f_j) - x_(j+d/2) sin(p f_j),
  x_(j+d/2) cos(p f_j) + x_j sin(p f_j))`.
- **Decoder layer** (Qwen3, pre-norm; used by the target, the MTP layer and the draft):
  `u = input_layernorm(x)`; per head `q = RoPE(q_norm(q_proj u))`, `k = RoPE(k_norm(k_proj u))`,
  `v = v_proj u` (q_norm / k_norm are RMSNorms over the {tgt_cfg['head_dim']} dims of each head, applied
  before RoPE; no biases); attention `softmax(q·k / sqrt(d))` over the allowed keys, the query heads
  all reading the single KV head; `x = x + o_proj(concat heads)`; then
  `x = x + down_proj(silu(gate_proj w) * up_proj w)` with `w = post_attention_layernorm(x)`.
- **Target**: `x = E[t]`, positions 0..n-1, layers 0..{tgt_cfg['num_hidden_layers'] - 1} causal;
  `r_l(t)` = the raw output of layer l (the residual stream after the layer, no norm);
  `h_t = model.norm(r_{tgt_cfg['num_hidden_layers'] - 1}(t))`; logits `lm_head h_t` predict t+1.
- **MTP / NextN layer** (`model.layers.{tgt_cfg['num_hidden_layers']}.*`; embedding and lm_head are the
  target's): row i (0 ≤ i ≤ n-2) takes the final-normed target hidden h_i and the embedding of the next
  token t_(i+1): `m_i = eh_proj [enorm(E[t_(i+1)]) ; hnorm(h_i)]` (embedding half first; `eh_proj.weight`
  [H, 2H]); then one decoder layer (tensors `model.layers.{tgt_cfg['num_hidden_layers']}.self_attn.*`, `.mlp.*`,
  `.input_layernorm`, `.post_attention_layernorm`) over the rows m_0..m_i, causal, **row i at RoPE
  position i**; then `shared_head.norm`, then the target's `lm_head`: the logits predict **t_(i+2)**.
  In decoding, once the target has produced h_i and the token t_(i+1), MTP row i drafts t_(i+2); its
  KV cache holds one row per committed position.
- **DSpark draft** (`dspark/`, DeepSpec `Qwen3DSparkModel`, anchor-first blocks, B = {m['draft_shape']['block_size']}):
  - context rows: `ctx(t) = hidden_norm(fc [{'; '.join(f'r_{i}(t)' for i in layers)}])` (`target_layer_ids`
    {layers}, concatenated in that order; **raw** layer outputs, not the last layer's: llama.cpp
    exposes only the inputs of layers 0..{tgt_cfg['num_hidden_layers'] - 1} to a draft; `fc.weight` [H, {len(layers)}H]);
  - in **each** of the {m['draft_shape']['num_draft_layers']} draft layers the same ctx rows give keys
    `RoPE_t(k_norm(k_proj ctx(t)))` and values `v_proj ctx(t)` **without** `input_layernorm` (as DeepSpec);
  - block rows: `[E[anchor], E[<|mask|>] x {m['draft_shape']['block_size'] - 1}]` at positions a..a+{m['draft_shape']['block_size'] - 1},
    where the anchor is the token at position a (the last committed token, which the target has not
    processed yet); they go through the decoder layers with `input_layernorm` as usual;
  - a block row's query sees the context rows t < a (strictly before the anchor) and all
    {m['draft_shape']['block_size']} rows of its block (bidirectional);
  - `hid_k = norm(x_k)`, base logits `U_k = lm_head hid_k`; slot k (0-based) predicts the token at
    position a+k+1, so slot 0 predicts the token right after the anchor;
  - Markov head (vanilla, rank {m['draft_shape']['markov_rank']}): `z_k = U_k + markov_w2 markov_w1[x_(k-1)]`
    (`markov_w1.weight` [V, r] is an embedding table, `markov_w2.weight` [V, r] a linear layer), with
    x_(-1) = the anchor and x_(k-1) the draft token chosen at slot k-1; greedy drafting takes
    `d_k = argmax z_k` left to right;
  - confidence: `c_k = sigmoid(confidence_head.proj.weight · [hid_k ; markov_w1[x_(k-1)]] + bias)`; with a
    threshold θ the proposal is d_0..d_(n-1), n = the first k with c_k < θ (per position, not cumulative);
  - after verification the target's features of the committed rows join the context, and the
    correction / bonus token becomes the next anchor.

## Training ({times['total_wall_s'] / 60:.1f} min wall in all on 2 cores, niced; step counts are fixed)

{bench_lines}
| stage | steps / size | wall time seen |
|---|---|---|
| corpus + tokenizer | {c['file_count']} files | {times['corpus_s']:.0f} s |
| target | {plan['target_steps']} steps × {plan['target_batch']}×{plan['target_seq']} tokens ({tg['tokens_seen']:,} tokens, {tg['epochs']:.1f} epochs) | {tg['wall_s'] / 60:.1f} min |
| MTP layer | {plan['mtp_steps']} steps × {plan['mtp_batch']}×{plan['mtp_seq']} | {mtp['wall_s'] / 60:.1f} min |
| DSpark draft | `ds4tools distill`: {ds['steps']} steps × {ds['resolved']['batch_windows']} windows × {ds['resolved']['blocks_per_window']} blocks ({ds['data']['text_windows']} windows of {ds['data']['seq_len']} tokens) | {ds['wall_s'] / 60:.1f} min |
| evaluation | | {ev['wall_s'] / 60:.1f} min |

- **Target**: AdamW (0.9, 0.95), weight decay {plan['target_wd']} on matrices, peak LR {plan['target_lr']:g},
  {plan['target_warmup']} warm-up steps, cosine to {plan['target_min_lr_frac']:g}×, grad clip 1, bf16 autocast,
  random windows of the concatenated train split. **Held-out loss {ev['target_heldout_loss']:.4f}
  nats/token** ({ev['target_heldout_loss'] * tk['heldout_tokens_per_byte'] / 0.6931:.3f} bits/byte) on all
  {ev['target_heldout_tokens']:,} held-out tokens in 512-token segments, with the shipped f16 weights;
  64 fixed train windows: {tg['train_windows_loss_fp32_weights']:.4f}; final train-loss EMA
  {tg['loss_history'][-1][1]:.4f}.
- **MTP layer**: trained after the target, target frozen; decoder initialised from the target's last
  layer; loss {mtp['loss']}; final EMA KL {mtp['loss_history'][-1][1]:.3f}, CE {mtp['loss_history'][-1][2]:.3f}.
{_dspark_training(m)}

## Measured (torch, fp32 compute on the shipped f16 weights)

The draft learned from the Q8_0 target's features; here it is paired with the f16 target in fp32
(the protocol every figure on this page uses); distill's own figures, engine and Q8_0 files, are in
the training section above.

- **MTP two-ahead agreement** (top-1 of the MTP layer vs the target's greedy token at i+2):
  **{ev['mtp_heldout']['agreement_with_target_two_ahead']:.4f}** on held-out text
  ({ev['mtp_heldout']['rows']:,} rows, teacher-forced); {ev['generated_greedy']['mtp_agreement_two_ahead']:.4f}
  along the target's greedy generations, {ev['generated_t1']['mtp_agreement_two_ahead']:.4f} along its T=1
  generations. (Top-1 vs the real token two ahead on held-out text: {ev['mtp_heldout']['top1_vs_real_token_two_ahead']:.4f}.)
- **DSpark τ** = mean tokens committed per verify step (accepted drafts + the bonus/correction token),
  block 8, greedy verification: a draft token is accepted while it equals the target's greedy token
  (reference: the target's greedy 8-token continuation from each anchor). Held-out text: anchors at
  every {plan['eval_anchor_stride']} tokens from position 32 of each 512-token segment of the held-out files. Generations:
  {m['n_prompts']} prompts × {plan['eval_gen_tokens']} generated tokens, an anchor at every generated position.
  The prompt-lookup drafter copies what followed the most recent earlier occurrence of the last 3-gram
  (else 2-gram, else 1-gram), up to 8 tokens, on the same anchors; no model.

{_tau_table(ev)}

Raw per-position match of the DSpark draft on held-out text (slot k vs the reference, regardless of
earlier slots): {_fmt_list(ho['dspark_raw_match_per_position'])}.

**Reading these figures.** A tiny model's greedy output loops, and there copying beats any draft: compare
each τ with the prompt-lookup τ on the same text, not with 1. Real held-out text and T=1 generations are
loop-free and are the honest numbers.

Goal check: DSpark τ ≥ 2.5 on held-out text and above prompt lookup: **{'met' if ok_tau else 'not met'}**
({ho['dspark']['tau']:.3f} vs {ho['prompt_lookup']['tau']:.3f}); MTP two-ahead agreement ≥ 50%:
**{'met' if ok_mtp else 'not met'}** ({ev['mtp_heldout']['agreement_with_target_two_ahead']:.4f}).
{_shortfall(m) if not (ok_tau and ok_mtp) else ''}

## Reproduce

```bash
pip install -e ".[train]"            # torch (CPU build is enough)
python tools/train_demo.py           # resumable: rerun the same command after an interruption
python tools/train_demo.py --smoke   # a tiny end-to-end run into runs/demo_smoke (minutes)
# only the DSpark draft, from a finished `ds4tools distill --kind dspark ... --resume RUN` run
# (its figures measured again, metrics.json, reference.json and this card rewritten):
python tools/demo/import_distilled.py RUN --report OUT.distill.json
```

Seed {plan['seed']}; checkpoints and logs go to `runs/demo/`; the DSpark stage runs `ds4tools distill`
(seed {ds['options']['seed']}, {plan['ds_threads']} threads, `--steps {plan['ds_steps']}`) with its run directory in
`runs/demo/distill-dspark`. Results depend on the Python version (the corpus) and, in the last bits,
on the CPU's bf16 matmul kernels and torch's thread count.
"""
