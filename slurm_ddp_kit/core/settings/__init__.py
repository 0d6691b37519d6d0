"""The kit's settings, in three modules: `schema` (the typed dataclasses and their choices),
`rules` (what a config must meet, and the sizes derived from it) and `loading` (defaults ← YAML
file ← `key=value` overrides, and the plain-value round trip that run folders store)."""
