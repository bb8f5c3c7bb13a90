"""The 12 Hz codec: decoder (full and streaming), Mimi encoder, random speech_tokenizer folders.

    CodecDecoder.from_weights(codec_config, weights, dtype, device).decode(codes [B, 16, T]) -> [B, T·1920]
    StreamingDecoder(decoder, max_streams, dtype, device): reset(slots [B]); decode_frame(slots, codes [B, 16])
    CodecEncoder.from_weights(codec_config, weights, dtype, device).encode(wav [n] @ 24 kHz) -> codes [T, 16]
    load_codec(codec_config, codec_weights, dtype, device) -> Codec(config, decoder, encoder)
    write_speech_tokenizer(out_dir, scale, seed, dtype) -> out_dir/speech_tokenizer
"""

from .checkpoint import Codec, load_codec, random_codec_state, read_speech_tokenizer, write_speech_tokenizer
from .decoder import CodecDecoder
from .encoder import CodecEncoder
from .streaming import StreamingDecoder

__all__ = ["Codec", "CodecDecoder", "CodecEncoder", "load_codec", "random_codec_state",
           "read_speech_tokenizer", "StreamingDecoder", "write_speech_tokenizer"]
