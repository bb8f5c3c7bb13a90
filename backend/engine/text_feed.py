"""`TextFeed`: the text of one sequence as it arrives, and the text ids the talker takes (torch-free).

'whole' mode: the pieces are only collected; the prompt holds all of the text once it ended and
nothing trails (every decode step adds E_pad). 'incremental' mode (spec b.3, b.4): the text track
is `head ⧺ T0, T1, ... ⧺ [tts_eos]`, where T are the text's token ids, committed as the pieces arrive
(`TextStream`), `head` is empty or, for Base ICL, the reference transcript's ids, and tts_eos
comes once the text ended. The first `prompt_rows` rows of the track are in the prompt (1 = T0;
Base ICL: `q3tts.models.prompt.icl_prefill_rows`), the rest trail: decode step t adds trailing[t],
and E_pad past the end, which is only right once the text has ended.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from q3tts.core import InvalidRequest

from .text_stream import TextStream


@dataclass(eq=False)
class TextFeed:
    mode: str                          # 'whole' | 'incremental'
    stream: TextStream | None = None   # incremental: tokenizes the pieces as they arrive
    head: list[int] = field(default_factory=list)  # track rows before the text (Base ICL)
    prompt_rows: int = 1               # track rows that go into the prompt
    eos_id: int = -1                   # tts_eos: the track's last row once the text ended
    max_trailing: int | None = None    # more trailing ids are refused (the slot's text queue rows)
    text: str = ""                     # all text so far
    done: bool = False
    trailing: list[int] = field(default_factory=list)  # trailing ids known so far
    num_queued: int = 0                # trailing ids already copied into the slot's text queue
    num_tokens: int = 0                # the text's tokens known so far (the default frame cap follows them;
    # whole mode: counted once, by InputProcessor.build_prompt when the text ended)

    def add(self, piece: str, done: bool = False) -> None:
        """Take a piece of text and/or its end. Raises InvalidRequest when the trailing ids outgrow
        `max_trailing`."""
        self.text += piece
        if self.stream is not None:
            if piece:
                self.stream.append(piece)
            if done:
                self.stream.end()
        self.done = self.done or done
        if self.stream is not None:
            self.num_tokens = len(self.stream.ids)
        if self.mode == "incremental":
            track = self.head + self.stream.ids + ([self.eos_id] if self.done else [])
            trailing = track[self.prompt_rows:]
            if self.max_trailing is not None and len(trailing) > self.max_trailing:
                raise InvalidRequest(f"text of {len(trailing)} trailing tokens exceeds max_text_tokens="
                                     f"{self.max_trailing}")
            self.trailing = trailing

    @property
    def is_ready(self) -> bool:
        """The prompt can be built: the text ended, or (incremental) the prompt's track rows are known."""
        return self.done or (self.mode == "incremental"
                             and len(self.head) + len(self.stream.ids) >= self.prompt_rows)

    def covers(self, frame: int) -> bool:
        """Frame `frame`'s text row is known (or can only be E_pad): the sequence may make it now."""
        return self.mode == "whole" or self.done or len(self.trailing) > frame

    def prompt_text(self) -> str:
        """The text the prompt is built from (all of it so far); InvalidRequest if it ended empty."""
        if self.done and not (self.stream.ids if self.stream is not None else self.text.strip()):
            raise InvalidRequest("text is empty")
        return self.text
