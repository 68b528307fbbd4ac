"""Load math problems from the hub or local files and turn them into prompts."""

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def format_prompt(problem: str, tokenizer) -> str:
    """The prompt text for one problem: the chat template when the tokenizer has one, else a plain Q/A frame."""
    content = f"{problem}\n{INSTRUCTION}"
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": content}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"Question: {content}\nAnswer:"
