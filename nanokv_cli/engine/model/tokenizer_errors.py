"""The tokenizer's errors, in a module of their own so that chat_template.py (which raises
ChatTemplateError) and tokenizer.py (which renders through it) import one way only."""


class TokenizerError(ValueError):
    """The tokenizer files or metadata cannot be turned into a working tokenizer."""


class ChatTemplateError(TokenizerError):
    """The model has no chat template, or its template refused the conversation."""
