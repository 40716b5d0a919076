"""Typed errors. Every error a user can cause maps to an OpenAI-style HTTP error on the server.

`status`, `type` and `code` follow the OpenAI error body
`{"error": {"message", "type", "param", "code"}}`; `param` names the offending field.
"""
from __future__ import annotations


class MMJaxError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequestError(MMJaxError):
    """The request itself is wrong (400)."""
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ImageError(InvalidRequestError):
    """Image bytes that cannot be decoded, are empty, or are of an unsupported kind."""
    code = "invalid_image"


class ImageTooLargeError(ImageError):
    """Image over the byte or pixel limit (413)."""
    status = 413
    code = "image_too_large"


class VideoError(InvalidRequestError):
    """Video bytes that cannot be decoded (corrupt, unsupported container or codec, no video
    stream) or that took longer than the decode time limit."""
    code = "invalid_video"


class VideoTooLargeError(VideoError):
    """Video over a byte, duration, frame-count or declared-resolution limit (413)."""
    status = 413
    code = "video_too_large"


class PromptError(InvalidRequestError):
    """Prompt and images do not fit together (placeholder count, injection, too many images)."""
    code = "invalid_prompt"


class ContextLengthError(InvalidRequestError):
    """Prompt (text + image tokens) longer than the model's context, or over an image-token budget."""
    code = "context_length_exceeded"


class CheckpointError(MMJaxError):
    """A checkpoint that cannot be loaded: missing/unexpected/mis-shaped tensors, bad config."""
    type = "checkpoint_error"
    code = "invalid_checkpoint"


class UnsupportedModelError(CheckpointError):
    code = "unsupported_model"


class QueueFullError(MMJaxError):
    status = 503
    type = "server_busy"
    code = "queue_full"


class LoRAError(InvalidRequestError):
    """A LoRA adapter that cannot be served: a malformed adapter directory, an option mmjax does not
    implement (DoRA, biases, modules_to_save, ...), a rank over --max-lora-rank, no free slot."""
    code = "invalid_lora_adapter"


class LoRANotFoundError(InvalidRequestError):
    """A request names a model / adapter the server does not serve (404)."""
    status = 404
    code = "model_not_found"
