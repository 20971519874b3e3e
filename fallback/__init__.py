"""edgenode fallback: the deterministic rule engine, the legacy system and safety net.

Pure code: no zmq, no processes, no ``node`` imports (only ``broker.errors`` and
``broker.protocol`` from the project), so everything here is table-testable. Rule patterns
need ``google-re2`` (``import re2``); without it the import fails loudly.

* ``fallback.rules``   load and validate rule files (format: ``etc/rules.toml``).
* ``fallback.rule_keys`` each key of one rule, checked and converted alone (for ``fallback.rules``).
* ``fallback.regex``   the rules' regular expressions, on RE2: linear time, no backtracking.
* ``fallback.engine``  ``RuleEngine``: first matching rule answers a worker REQUEST body.
* ``fallback.compare`` field-by-field comparison of two outputs (shadow and dual runs).
* ``fallback.intents`` ``INTENT_SCHEMA``, the JSON Schema of the default rules' answers.
* ``fallback.template``, ``fallback.text``  response templates; normalisation and keywords.
"""
