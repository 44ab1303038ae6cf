"""``/tokenize`` and ``/detokenize``: vLLM's endpoints (``vllm bench serve`` looks for them).

    POST /tokenize    {model?, prompt, add_special_tokens=true, return_token_strs=false}
                      {model?, messages, add_generation_prompt=true, add_special_tokens=false, ...}
                   -> {count, max_model_len, tokens, token_strs}
    POST /detokenize  {model?, tokens} -> {prompt}

Tokens are counted as the completion endpoints count them (the same chat template and
tokenizer), whatever the context length; ``max_model_len`` is null until a worker reports it.
"""

from __future__ import annotations

from pdserve.engine.tokenizer import ModelTokenizer
from pdserve.router.protocol import (
    DetokenizeRequest,
    OpenAIError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    template_messages,
)


def tokenize(tokenizer: ModelTokenizer, body: TokenizeCompletionRequest | TokenizeChatRequest,
             max_model_len: int | None) -> dict:
    if isinstance(body, TokenizeChatRequest):
        try:
            text = tokenizer.apply_chat_template(template_messages(body.messages), body.add_generation_prompt)
        except Exception as e:  # a template may raise on inputs it does not accept
            raise OpenAIError(400, f"messages: cannot apply the chat template: {e}", param="messages") from e
    else:
        text = body.prompt
    ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    strs = [tokenizer.id_to_token(i) or "" for i in ids] if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(tokenizer: ModelTokenizer, body: DetokenizeRequest) -> dict:
    bad = next((t for t in body.tokens if not 0 <= t < tokenizer.vocab_size), None)
    if bad is not None:
        raise OpenAIError(400, f"tokens: token id {bad} is out of the vocabulary (0 to {tokenizer.vocab_size - 1})",
                          param="tokens")
    # Special tokens are kept, as vLLM does: tokenize then detokenize gives the templated text back.
    return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
