"""The official `openai` client against a kvgate worker serving the `llama-f32-v5` reference
fixture (word-level tokenizer: token i is the word `t<i>`). Run by worker/tests/clients.rs:
    python openai_fields.py BASE_URL
Each check asserts what the field promises; the first failure exits non-zero naming it."""

import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
PROMPT = [23, 103, 92, 57, 14]


def words(text):
    return [int(w[1:]) for w in text.split()]


def check(name, ok, detail=""):
    if not ok:
        sys.exit(f"{name}: {detail}")
    print(f"ok: {name}")


# Token-id prompts and greedy text.
greedy = client.completions.create(model="llama-f32-v5", prompt=PROMPT, max_tokens=8, temperature=0)
text = greedy.choices[0].text
check("token-id prompt", len(words(text)) == 8 and greedy.usage.prompt_tokens == 5, text)

# `stop`: cut before the stop string (which may span tokens), finish_reason "stop".
stop_at = " ".join(text.split()[2:4])
stopped = client.completions.create(model="llama-f32-v5", prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop_at, "zzz"])
c = stopped.choices[0]
check("stop", c.finish_reason == "stop" and c.text == text[: text.index(stop_at)], repr((c.text, c.finish_reason, stop_at)))

# `logprobs` (completions): one per token, the top alternatives, offsets into the text.
lp = client.completions.create(model="llama-f32-v5", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3).choices[0].logprobs
check("logprobs", len(lp.tokens) == 4 and all(len(t) == 3 for t in lp.top_logprobs), repr(lp))
check("logprobs greedy", all(max(t.values()) == p for t, p in zip(lp.top_logprobs, lp.token_logprobs)), repr(lp))

# `echo` with logprobs: the prompt first (no log-probability for its first token), then the answer.
echo = client.completions.create(model="llama-f32-v5", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True).choices[0]
check("echo", echo.text.startswith("t23 t103 t92 t57 t14") and len(echo.logprobs.token_logprobs) == 6, repr(echo))
check("echo logprobs", echo.logprobs.token_logprobs[0] is None and all(p < 0 for p in echo.logprobs.token_logprobs[1:]), repr(echo.logprobs))

# `n`: independent choices, indexed; seeded sampling makes them reproducible.
many = client.completions.create(model="llama-f32-v5", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=3)
again = client.completions.create(model="llama-f32-v5", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=5, n=3)
check("n", [c.index for c in many.choices] == [0, 1, 2] and len({c.text for c in many.choices}) > 1, repr(many.choices))
check("n seeded", [c.text for c in many.choices] == [c.text for c in again.choices])

# Chat: `logprobs` + `top_logprobs`, `stop`, streaming with `n`.
chat = client.chat.completions.create(
    model="llama-f32-v5", messages=[{"role": "user", "content": "t1 t2"}], max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
)
content = chat.choices[0].logprobs.content
check("chat logprobs", len(content) == 3 and all(len(e.top_logprobs) == 2 for e in content), repr(content))
stream = client.completions.create(model="llama-f32-v5", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=9, n=2, stream=True)
texts = {0: "", 1: ""}
for chunk in stream:
    for c in chunk.choices:
        texts[c.index] += c.text
check("stream n", all(len(words(t)) == 5 for t in texts.values()), repr(texts))

# A field kvgate does not implement: 400 naming it.
try:
    client.completions.create(model="llama-f32-v5", prompt=PROMPT, max_tokens=2, presence_penalty=0.7)
    check("unsupported field", False, "presence_penalty was accepted")
except openai.BadRequestError as e:
    check("unsupported field", "presence_penalty" in str(e), str(e))
