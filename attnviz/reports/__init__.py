"""Files a researcher sends or files: the self-contained HTML report (:mod:`.html`) and the
one-command paper reproductions (:mod:`.reproduce`)."""
