# %% [markdown]
# # 10 · Serving: the engine behind an OpenAI-compatible server
#
# **You will learn** what a serving engine adds around the decode loop of `05_decode_loop`:
#
# 1. an **async engine loop**: one background thread steps the `LLM` while the web server
#    answers many clients on an asyncio event loop; each request gets its own output stream;
# 2. **streaming**: every engine step's new tokens leave as one server-sent event, turned into
#    text by an incremental detokenizer that also cuts the text at `stop` strings;
# 3. what the server **refuses** (bad input: 400 naming the field; a full queue: 503) and what
#    it **reports** (`/metrics` in Prometheus' format);
# 4. how a server is **measured**: requests arriving at random (a Poisson process) at several
#    rates, and the latency each client sees: time to first token (TTFT), time per output
#    token (TPOT), inter-token latency (ITL).
#
# The server runs as a separate process started from the next cells (`python -m fleetlab serve`),
# and we talk to it with OpenAI's official Python client, as any application would.

# %%
# %matplotlib inline
import httpx
from openai import OpenAI

import fleetlab
import fleetlab.lab  # the lab: its quiet mode keeps Paddle's import-time notices out
from fleetlab.lab import viz
from fleetlab.lab.bench import serving as serving_bench

# %% [markdown]
# ## 1. Start a server in the background
#
# `ServerProcess` runs `python -m fleetlab serve --model tiny ...` as a child process (on a free
# port) and returns once `/health` answers. The options are the engine's own: here at most 32
# requests run at once, in blocks of 16 tokens. The shipped tiny model answers arithmetic and
# counts, one character per token.

# %%
server = fleetlab.serving.ServerProcess(["--model", "tiny", "--max-num-seqs", "32", "--block-size", "16"])
print("serving at", server.base_url)
print(httpx.get(server.url + "/v1/models").json()["data"])

# %% [markdown]
# ## 2. Ask it something with the official client
#
# `temperature=0` is greedy decoding: the same tokens `LLM.generate` gives offline. `usage` counts
# the prompt's tokens (a BOS token and one per character) and the answer's (the EOS included).

# %%
client = OpenAI(base_url=server.base_url, api_key="not-needed")
reply = client.completions.create(model="tiny", prompt="12+7=", max_tokens=8, temperature=0)
print(repr(reply.choices[0].text), reply.choices[0].finish_reason, reply.usage)

chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "45+38="}],
                                      temperature=0)
print(repr(chat.choices[0].message.content), chat.choices[0].finish_reason)

# %% [markdown]
# The chat endpoint needs a *chat template* to turn messages into a prompt. A real tokenizer
# carries its own; the tiny model's character tokenizer has none, so fleetlab uses a minimal one:
# each message's text on its own line. A single user message `"45+38="` is therefore the prompt
# `"45+38="`, which the tiny model was trained to answer.
#
# ## 3. Stream a completion into this cell
#
# With `stream=True` the server writes a chunk as soon as the engine has new tokens for the
# request (a `|` marks the end of each chunk below): usually one chunk per engine step, one
# token each here. When the engine runs ahead of the connection, the tokens of the steps
# that piled up go out together in one chunk, so a chunk may carry several tokens; the
# text is the same either way. The EOS token is not text: the chunk it ends carries only
# the `finish_reason`. `stream_options={"include_usage": True}` adds a last chunk with the
# token counts.

# %%
stream = client.completions.create(model="tiny", prompt="count 3 ", max_tokens=24, temperature=0, stream=True,
                                   stream_options={"include_usage": True})
chunk_texts = []
for chunk in stream:
    if chunk.choices:
        chunk_texts.append(chunk.choices[0].text)
        print(chunk.choices[0].text, end="|", flush=True)
        finish = chunk.choices[0].finish_reason
    else:
        usage = chunk.usage
        print(f"\nfinish_reason={finish!r}, usage: {usage}")
print(f"{len(chunk_texts)} chunks for {usage.completion_tokens} tokens")

# %% [markdown]
# A `stop` string ends the answer where it appears, and is not part of the text. The server holds
# back any text that could be the beginning of a stop string, so that a stop string split over two
# steps is never half sent; once it appears, the engine request is aborted and its KV blocks freed.

# %%
stopped = client.completions.create(model="tiny", prompt="count 3 ", max_tokens=24, temperature=0, stop=["8"])
print(repr(stopped.choices[0].text), stopped.choices[0].finish_reason)

# %% [markdown]
# ### Several answers, and how sure the model was
#
# `n=3` asks for three answers to one prompt. The engine runs them as three requests that share the
# prompt's KV blocks (the prefix cache hands the first one's full blocks to the others), and answer
# `i` samples with seed `seed + i`: with `temperature=1` they differ, and the same `seed` gives the
# same three again. `logprobs=3` returns, for every token of an answer, its log-probability and the
# three most likely tokens at that position, from the model's raw logits (before temperature or
# penalties, as vLLM reports them).

# %%
three = client.completions.create(model="tiny", prompt="count 3 ", max_tokens=8, temperature=1.0, seed=1, n=3)
for choice in three.choices:
    print(choice.index, repr(choice.text))

sure = client.completions.create(model="tiny", prompt="12+7=", max_tokens=4, temperature=0, logprobs=3)
lp = sure.choices[0].logprobs
for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
    alternatives = ", ".join(f"{t!r}: {v:.2f}" for t, v in sorted(top.items(), key=lambda kv: -kv[1]))
    print(f"{token!r:8} logprob {logprob:7.3f}   top: {alternatives}")

# %% [markdown]
# The three answers differ (with these weights and `seed=1`: `'4 5 6 7'`, `'4 5'` and `'4 5 6 7 '`;
# the second drew the EOS token early). The log-probabilities show what greedy decoding hides: the
# tiny model is sure of the `1` (logprob -0.01, probability 0.99) but torn on the second digit, `9`
# at -0.61 (probability 0.54) against `8` at -0.79 (0.45). Greedy takes the `9`; a sampled answer
# says `18` almost half the time. The EOS token that ends the answer shows as `<eos>`. `echo=True`
# with `logprobs` also scores the prompt's own tokens, which is how evaluation harnesses compute a
# text's likelihood.
#
# ## 4. What the server refuses, and what it reports
#
# Bad input is answered at once with HTTP 400 and an OpenAI-style error body naming the field, and
# the server goes on serving. A model the server does not serve is a 404, as OpenAI's API answers
# it (the second request below). (A queue beyond `--max-queue-len` waiting requests is answered 503.)

# %%
refusals = []
for body in ({"model": "tiny", "prompt": "1+1=", "temperature": 7},
             {"model": "gpt-4", "prompt": "1+1="},
             {"model": "tiny", "prompt": "1+1=", "max_tokens": 1000}):
    r = httpx.post(server.url + "/v1/completions", json=body)
    refusals.append((r.status_code, r.json()["error"]["param"]))
    print(r.status_code, r.json()["error"]["param"], "--", r.json()["error"]["message"])
print("health:", httpx.get(server.url + "/health").status_code)

# %% [markdown]
# `/metrics` speaks Prometheus' text format, with the names vLLM uses (`fleetlab:` instead of
# `vllm:`): the engine's state at the time of the scrape, and histograms of what requests saw.

# %%
metrics = httpx.get(server.url + "/metrics").text
wanted = ("fleetlab:num_requests_running{", "fleetlab:num_requests_waiting{", "fleetlab:kv_cache_usage_perc{",
          "fleetlab:time_to_first_token_seconds_count", "fleetlab:time_to_first_token_seconds_sum",
          "fleetlab:generation_tokens_total", "fleetlab:request_success_total")
print("\n".join(line for line in metrics.splitlines() if line.startswith(wanted)))

# %% [markdown]
# ## 5. Measure it: latency against the request rate
#
# `fleetlab.lab.bench.serving` (also `python -m fleetlab bench serve`) sends the same 20 prompts at
# several rates, request `i` leaving at the `i`-th arrival of a Poisson process, each asking for a
# fixed number of tokens (8 to 24, `ignore_eos`). "all at once" sends all 20 together. Each client
# times its own stream:
#
# - **TTFT**: from sending the request to its first chunk;
# - **TPOT**: the rest of the stream divided by the tokens after the first;
# - **ITL**: the gaps between consecutive chunks.

# %%
result = serving_bench.run_benchmark(server.url, rates=[8, 24, 72, float("inf")], num_prompts=20,
                                     output_len=(8, 24))
print(serving_bench.table(result))
serving_bench.draw(result)

# %% [markdown]
# How to read it. Twenty requests per rate on a shared two-core CPU is a small sample: the
# numbers move from run to run, by more than some of the effects below. So next to this run,
# the cell after it prints the stored full run (`python -m fleetlab bench serve`: 64 requests
# per rate, `benchmarks/results/serving.json`), where they stand out.
#
# - **Throughput** (bottom right) follows the offered load while the server keeps up: in the
#   stored run, 2 and 8 requests per second offered, about as many finished. From 32 on it
#   falls well short of the offered load: the server is saturated, and sending faster makes
#   requests wait. The bars still never stop growing (in the stored run, and most likely in
#   this one): the more requests wait, the more share each step, and a bigger step costs
#   less per token. Saturation on this server is a bend in the curve, not a wall.
# - **TTFT** grows once requests arrive faster than the server clears them: they wait for the
#   steps that serve the others' prefills (and for a free row, once `--max-num-seqs` run).
# - **TPOT and ITL** grow with the number of requests running together: more requests in
#   every step make each step longer, and every running request waits for the whole step.
#   That is the trade of continuous batching: more tokens per second for everyone, each a
#   little slower. It shows from the lowest rate to the highest; between two neighbouring
#   rates the wobble can hide it (in the stored run too), and in a 20-request run on a shared
#   machine even the ends can swap: the cell below says whether this run shows it.
# - **p99** sits above the median: a few requests arrive behind a burst, or share their
#   steps with several prefills.

# %%
def by_rate(runs, value):
    return ", ".join(f"{run['rate']}: {value(run):.1f}" for run in runs)


stored = viz.load_results().get("serving")
for name, runs in (("this run", result["runs"]), ("stored run", stored["runs"] if stored else [])):
    if runs:
        tpot = [run["tpot_ms"]["median"] for run in runs]
        print(f"{name}, by rate -- req/s {by_rate(runs, lambda run: run['request_throughput'])}")
        print(f"    median TTFT ms {by_rate(runs, lambda run: run['ttft_ms']['median'])}")
        print(f"    median TPOT ms {by_rate(runs, lambda run: run['tpot_ms']['median'])} "
              f"(higher at the highest rate than at the lowest: {tpot[-1] > tpot[0]})")

# %% [markdown]
# ## 6. Stop the server
#
# `stop()` sends Ctrl-C (SIGINT): uvicorn finishes gracefully, the engine loop aborts whatever
# still runs, and the process exits with status 0.

# %%
print("exit status:", server.stop())

# %% [markdown]
# > **In vLLM / FastDeploy** `fleetlab.AsyncLLM` is vLLM's `AsyncLLM` (`vllm/v1/engine/async_llm.py`),
# > whose engine core runs in a separate process behind an `EngineCoreClient` (here: a thread);
# > the app is vLLM's OpenAI server (`vllm/entrypoints/openai/api_server.py`: the same endpoints,
# > `vllm:` metric names where fleetlab says `fleetlab:`), the incremental detokenizer its
# > `vllm/v1/engine/detokenizer.py`, and `bench serve` reports what its serving benchmark
# > (`vllm bench serve`) reports. FastDeploy serves third-party models the same way:
# > `python -m fastdeploy.entrypoints.openai.api_server --model PATH --model-impl paddlefleet`.

# %% [markdown]
# ## Try next
#
# - Start the server with `--max-num-seqs 4` and run the benchmark again: TTFT at "all at once"
#   jumps (requests queue for a row) while TPOT drops (small steps).
# - Serve the same weights through the Fleet-style model: `--model-impl fleet` (the tokens are the
#   same; `core_attention` is what gets patched).
# - From a terminal: `python -m fleetlab serve --model tiny`, then `curl` it, or point any
#   OpenAI-compatible client at `http://127.0.0.1:8000/v1`; `python -m fleetlab bench serve --url
#   http://127.0.0.1:8000` measures it at the default rates and writes `benchmarks/results/serving.png`.
# - Use `fleetlab.AsyncLLM` directly in your own asyncio code: `async for out in
#   engine.generate(prompt, SamplingParams(...))`.
