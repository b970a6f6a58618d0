"""Text around a session without transformers: chat templates (chat.py) under a time and size budget
(template_budget.py), and the export folder's tokenizer (tokenizer.py), shared by generate and serve."""
