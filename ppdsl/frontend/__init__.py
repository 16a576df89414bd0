"""The front end: `.pp` text -> AST (`parse`, with `syntax_errors` labelling
what lark rejects; `ast` and its one printer) -> schedule IR (`elaborate`, which
drives `expressions`, `declarations`, `order_form` and `block_form`; `blocks`
repeats a building block into per-device orders)."""
