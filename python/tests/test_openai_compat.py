"""The official `openai` client against the proxy of a real `rolloutcore serve` + `vllm-double`.

base_url is the proxy (serve's URL + "/v1"), as a trainer or eval harness would configure it.
"""
import openai
import pytest

MODEL = "rc-double-model"  # the double's served model name (conftest starts it with the default)
PROMPT = "The proxy must look like vLLM to"
MESSAGES = [{"role": "user", "content": "Say something short."}]
MAX_TOKENS = 7
KINDS = ["completions", "chat"]


@pytest.fixture
def client(serve):
    return openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def create(client, kind, **kwargs):
    if kind == "completions":
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                         **kwargs)
    return client.chat.completions.create(model=MODEL, messages=MESSAGES,
                                          max_tokens=MAX_TOKENS, **kwargs)


def text_of(kind, choice):
    """The generated text of a response choice or of a streamed chunk's choice."""
    if kind == "completions":
        return choice.text
    message = getattr(choice, "message", None) or choice.delta
    return message.content or ""


def test_models_list_names_the_served_model(client):
    # Proves models.list() through the proxy returns vLLM's ModelList with the served model, the
    # first call most OpenAI clients make; would catch a proxy that does not pass /v1/models.
    models = client.models.list()
    cards = {m.id: m for m in models.data}
    assert MODEL in cards
    assert cards[MODEL].object == "model"
    assert cards[MODEL].owned_by == "vllm"


@pytest.mark.parametrize("kind", KINDS)
def test_create_returns_a_parsed_completion(client, kind):
    # Proves completions.create / chat.completions.create parse the proxied answer into the
    # client's types with consistent usage; would catch a body the client cannot parse, a wrong
    # "object", or usage that disagrees with itself.
    r = create(client, kind)
    assert r.object == ("text_completion" if kind == "completions" else "chat.completion")
    assert r.model == MODEL
    assert len(r.choices) == 1
    assert r.choices[0].finish_reason == "length"
    assert text_of(kind, r.choices[0])
    if kind == "chat":
        assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == MAX_TOKENS
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_stream_without_usage_streams_the_same_text(client, kind):
    # Proves a plain stream (no stream_options) yields one token per chunk, the same text as the
    # non-streamed call, and no usage anywhere (the proxy adds include_usage upstream and must
    # hide it); would catch a leaked usage-only chunk (choices == []) that breaks clients reading
    # chunk.choices[0], or a stream that differs from the full answer.
    full = text_of(kind, create(client, kind).choices[0])
    chunks = list(create(client, kind, stream=True))
    assert all(c.choices for c in chunks), "a chunk without choices the client did not ask for"
    assert all(c.usage is None for c in chunks)
    pieces = [text_of(kind, c.choices[0]) for c in chunks]
    assert "".join(pieces) == full
    assert sum(1 for p in pieces if p) == MAX_TOKENS
    assert chunks[-1].choices[0].finish_reason == "length"
    if kind == "chat":
        assert chunks[0].choices[0].delta.role == "assistant"


@pytest.mark.parametrize("kind", KINDS)
def test_stream_with_include_usage_ends_with_the_usage_chunk(client, kind):
    # Proves stream_options={"include_usage": True} delivers exactly one final chunk with
    # choices == [] and usage whose completion_tokens equals the tokens streamed and whose
    # prompt_tokens equals the non-streamed count; would catch a missing usage chunk (token
    # accounting reads 0) or counts that disagree with what was streamed.
    prompt_tokens = create(client, kind).usage.prompt_tokens
    chunks = list(create(client, kind, stream=True, stream_options={"include_usage": True}))
    usage_chunks = [c for c in chunks if not c.choices]
    assert len(usage_chunks) == 1
    assert chunks[-1] is usage_chunks[0], "usage must come after the last choice chunk"
    usage = usage_chunks[0].usage
    streamed = sum(1 for c in chunks[:-1] if text_of(kind, c.choices[0]))
    assert streamed == MAX_TOKENS
    assert usage.completion_tokens == streamed
    assert usage.prompt_tokens == prompt_tokens
    assert usage.total_tokens == prompt_tokens + streamed
    assert all(c.usage is None for c in chunks[:-1])
