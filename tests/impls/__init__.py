"""Implementations the harness's own tests plug in through --impl (correct, crashing, hanging)."""
