"""``leyline eval proxy``: stale tool outputs as distractors, with and without the policy."""
