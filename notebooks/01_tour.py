# %% [markdown]
# # 01 · A tour of fleetlab
#
# **You will learn** how an inference engine serves many requests at once, by following a
# handful of prompts through fleetlab on a tiny model trained for this project:
#
# 1. the model on its own: the answers the engine must not change;
# 2. `fleetlab.LLM`: the same prompts served together;
# 3. what happened inside: who ran in which step, and where their keys and values lived;
# 4. two requests that share a prompt prefix, and the pieces you can open next.
#
# Everything runs on a CPU in seconds. The cells only *use* fleetlab: the engine's code
# lives in the `fleetlab` package, one small file per idea. Notebook 00 showed why an engine
# keeps a KV cache and what prefill and decode are; here they are at work, many requests at
# once.

# %%
# %matplotlib inline
import numpy as np

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out
from fleetlab.inspect.batch import batch_snapshot
from fleetlab.lab import viz

# %% [markdown]
# ## 1. The model on its own
#
# fleetlab ships a tiny Llama (a real PaddleFormers `LlamaForCausalLM`) trained on
# arithmetic and short sentences, with a *character* tokenizer: one character is one
# token, so every token can be read by eye.

# %%
model, tokenizer = fleetlab.models.load_tiny()
num_params = sum(int(np.prod(p.shape)) for p in model.parameters())
print(f"{type(model).__name__}: {num_params / 1e6:.2f}M parameters, "
      f"{model.config.num_hidden_layers} layers, vocabulary {tokenizer.vocab_size}")
print("'12+7=' ->", tokenizer.encode("12+7="), "(1 is <bos>)")

# %% [markdown]
# Before any engine, ask the model itself. `complete` runs the model's plain forward pass
# over the whole sequence for every new token, with no cache at all: slow, but there is
# nothing in it to get wrong. It is our **oracle**. (The model is small and not always
# right. That does not matter here: the engine's job is to reproduce the model, right or
# wrong.)

# %%
from fleetlab.models.pretrained import complete

prompts = ["45+38=", "23+19=", "3+4=", "6*7=", "count 3 4 5", "the dog"]
expected = complete(model, tokenizer, prompts, max_new_tokens=12)
for prompt, answer in zip(prompts, expected):
    print(f"{prompt!r:>15} -> {answer!r}")

# %% [markdown]
# ## 2. Serve them together with `fleetlab.LLM`
#
# `LLM` patches the model's attention so it reads and writes a **paged KV cache**, sizes
# a **block pool** for that cache, and runs a loop of **engine steps**. In each step the
# **scheduler** picks which requests run and how many tokens each, within a token budget
# (`max_num_batched_tokens`) and a number of rows (`max_num_seqs`). We also ask it to keep
# a trace of every step, to draw it afterwards.

# %%
llm = fleetlab.LLM(model, tokenizer, block_size=4, num_blocks=48, max_num_batched_tokens=24, max_num_seqs=4,
                   record_traces=True)
params = fleetlab.SamplingParams(max_tokens=12)  # greedy decoding, as the oracle
outputs = llm.generate(prompts, params, use_tqdm=False)
for out, want in zip(outputs, expected):
    prompt = tokenizer.decode(out.prompt_token_ids)
    print(f"req {out.request_id}: {prompt!r:>15} -> {out.text!r:<12} same as the oracle: {out.text == want}")

# %% [markdown]
# Same answers. The engine changed *how* the work was scheduled, not what the model
# computes. (Notebook 03 checks this down to the logits.)
#
# ## 3. What happened inside
#
# `llm.traces` holds one record per step. In the timeline below each lane is a request
# and each box a step it ran in. **Orange boxes are prefill**: prompt tokens go through
# the model (the number is how many). **Blue boxes are decode**: one new token. All six
# requests arrive before step 0 (the black triangles), but the four rows
# (`max_num_seqs=4`) are taken, so requests 4 and 5 wait: the thin grey bars, which
# `viz.queue_waits` reads from each step's trace (here: every row was taken). Request 4
# joins in step 2, right after request 2 finishes, and request 5 in step 3: a request takes
# a row the step after one frees, and steps 2 and 3 run prefill and decode side by side.
# That is **continuous batching**.
#
# The lines printed under the timeline say the same in text: each step's rows in the order
# the model ran them, each as `request:phase tokens` (`0:p7`: request 0 runs a 7-token
# prefill; `1:d1`: request 1 decodes one token), then the tokens the step ran in all, and
# which requests finished in it.

# %%
waits = viz.queue_waits(llm.traces, {out.request_id: 0 for out in outputs}, llm.config)
timeline = viz.draw_timeline(llm.traces, waits=waits)
timeline

# %%
for trace in llm.traces[:4]:
    print(viz.describe_step(trace))
print(llm.stats())

# %% [markdown]
# Every box of that timeline is one call of `LLM.step`: one step of the engine core
# (`EngineCore.step`, read here from the installed package), whose outputs the output
# processor then finishes (stop strings, logprobs, text). The scheduler plans (`schedule()`:
# who runs, how many tokens each), the model runner executes the plan (`_execute`, which
# calls `runner.execute`; a failure anywhere in the step undoes it all), and the scheduler commits what came
# back (`update`), the only place a request advances. The observers after it are how
# `record_traces=True` got the traces drawn above. Notebook 05 opens `schedule`, and
# notebook 12 follows one request through all three.

# %%
from fleetlab.engine.core import EngineCore

step_source = viz.show_source(EngineCore.step, body_only=True)
step_source

# %% [markdown]
# Each request's keys and values live in fixed-size **blocks** of the KV cache (here 4
# tokens each). The bars count the blocks each running request holds, in its colour: a
# request's bar grows by one block every 4 tokens and is gone the step after it
# finishes, so memory follows the work instead of being reserved up front. The black line
# is what is still held *after* each step: it drops below the bars exactly in the steps
# where a request finished (its blocks go back to the pool at the end of the step). The
# pool has 48 blocks; this small workload never needs more than a dozen.

# %%
occupancy = viz.draw_kv_occupancy(llm.traces)
occupancy

# %% [markdown]
# ## 4. Pause the engine mid-flight: two prompts with one prefix
#
# `generate` runs to the end; `add_request` and `step` let you stop anywhere. Queue two
# prompts that start with the same sentence, and run two steps.

# %%
shared = "the red cat sat on the mat. "
for text in [shared + "the dog", shared + "a cat"]:
    llm.add_request(text, fleetlab.SamplingParams(max_tokens=6))
for _ in range(2):
    llm.step()
    print(viz.describe_step(llm.traces[-1]))
for a in viz.admissions(llm.traces, block_size=4)[-2:]:
    print(f"req {a.request_id} admitted in step {a.step}: {a.num_cached_tokens} tokens already in the cache "
          f"(blocks {a.cached_block_ids})")

# %% [markdown]
# Request 6 (36 tokens: `<bos>` and 35 characters) runs its prompt in two chunks, 24
# tokens then the last 8 after the 4 it found cached (`<bos>the` is also how request 5,
# `"the dog"`, began). Request 7 joins in the second step. Its first 29 tokens are the same
# as request 6's, and 7 blocks of 4 of them (28 tokens) are already full and computed,
# so it takes them instead of computing them again: **prefix caching**. It runs only its
# last 6 tokens.
#
# The **block pool** after those two steps: one square per block of the cache, coloured by
# the request holding it. The 7 blocks both requests hold are hatched and marked `x2`
# (two owners). Grey dotted squares are free, but still remember the tokens of a finished
# request, in case a later prompt starts the same way; the number in the circle is the
# order in which the pool would overwrite them (1 first). White squares are free and
# empty. The pool hands out the front of one free queue, empty and cached blocks alike,
# so white blocks are not always taken first: here some of them wait behind cached ones.

# %%
frame = viz.pool_frame(llm)
pool_figure = viz.draw_block_pool(frame, ncols=16)
pool_figure

# %% [markdown]
# The **InputBatch** is the model runner's persistent table of running requests, one row
# each, here as the last step ran it: requests 6 and 7 each ran a prefill chunk (8 and 6
# tokens) on top of the 28 tokens they already had in the cache. The token each of them
# sampled is not in these rows yet: the scheduler committed it, and the runner learns it
# from the next step's message (the `SchedulerOutput`, which carries only what changed).
# Each row ends with `(computed/total in KV cache)`: of the request's tokens so far, how
# many have their K/V in the cache (notebook 04 opens these rows). Next step both decode.
# The rows survive from step to step (`batch_snapshot` reads them from the model runner).

# %%
batch_rows = batch_snapshot(llm.runner.batch, llm.runner.decode_threshold)
viz.draw_batch(batch_rows)

# %%
while llm.has_unfinished_requests():
    for out in llm.step():
        if out.finished:
            print(f"req {out.request_id} finished: {out.text!r} ({out.finish_reason})")
print(f"prefix cache hit rate: {llm.stats()['prefix_cache_hit_rate']:.0%}")

# %% [markdown]
# > **In vLLM / FastDeploy** the same parts have these names (the notebooks that follow
# > open one each):
# >
# > | fleetlab | vLLM (v1 engine) | FastDeploy |
# > | --- | --- | --- |
# > | `LLM`, `SamplingParams` | `LLM`, `SamplingParams` | `LLM`, `SamplingParams` |
# > | `Scheduler` | `Scheduler` (emits a `SchedulerOutput`) | `ResourceManagerV1` |
# > | `BlockPool`, prefix caching | `BlockPool`, `KVCacheManager` | `PrefixCacheManager` |
# > | `InputBatch` | `InputBatch` in the `GPUModelRunner` | `InputBatch` in its `GPUModelRunner` |
# > | `patch_model` | the Transformers modeling backend | the PaddleFormers backend |

# %% [markdown]
# ## Try next
#
# - **02_paged_kv_cache**: blocks, block tables, prefix sharing and eviction, with sliders.
# - **03_attention_patching**: how `LLM` took over the model's attention without editing its code.
# - **04_input_batch_reorder**: why and how the batch puts decode rows first.
# - **05_decode_loop**: the scheduler step by step, with preemption and a play button.
# - **06_performance**: continuous batching against static batches, measured.
# - **07_prototyping**: your own attention backend and scheduling policy.
#
# Or change the engine above: `max_num_seqs=1` (one request at a time: watch the timeline
# stretch), `block_size=16`, or `max_num_batched_tokens=8` (long prompts get split over
# several steps: *chunked prefill*).
