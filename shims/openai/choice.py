"""One choice's visible output, built token by token: text (stop strings, partial characters) and, when tools are in
play, the tool calls parsed out of it. Whole responses and streams both go through :class:`ChoiceOutput`, so a
stream's deltas always add up to the whole response. Pure: nothing here does I/O."""

from __future__ import annotations

from collections.abc import Sequence

from shims.openai.text import TextAssembler, Vocabulary
from shims.openai.tool_calls import ToolCallStream, ToolMode, constrained_calls


class ChoiceOutput:
    def __init__(self, vocab: Vocabulary, stops: Sequence[str], tools: ToolMode, *, include_stop: bool = False,
                 skip_special_tokens: bool = True) -> None:
        self.assembler = TextAssembler(vocab, stops, include_stop=include_stop, skip_special_tokens=skip_special_tokens)
        self.tools = tools
        self.calls = ToolCallStream() if tools.kind == "auto" else None
        self.held = ""
        self.called = False

    @property
    def tokens(self) -> list[int]:
        return self.assembler.tokens

    def push(self, tokens: Sequence[int], final: bool = False) -> tuple[str, list[dict]]:
        """Add sampled tokens; returns (content delta, tool calls completed by them). A forced call (``required`` or
        a named function) is JSON that only means something whole: it comes out at the end. A named function's text
        is never content, even cut short by ``max_tokens`` (vLLM's answer: the call with the partial arguments)."""
        delta = self.assembler.push(tokens, final)
        if self.calls is not None:
            content, calls = self.calls.push(delta, final)
        elif self.tools.kind in ("required", "named"):
            self.held += delta
            if not final:
                return "", []
            calls = constrained_calls(self.tools, self.held)
            content = "" if calls or self.tools.kind == "named" else self.held
        else:
            content, calls = delta, []
        self.called = self.called or bool(calls)
        return content, calls

    def finish_reason(self, stop_reason: str) -> str:
        """``tool_calls`` when the model called a tool of its own choice or was required to (a named function keeps
        the sampler's reason, as in vLLM and OpenAI)."""
        if self.called and self.tools.kind in ("auto", "required"):
            return "tool_calls"
        return stop_reason
