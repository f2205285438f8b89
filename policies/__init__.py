"""Policies choose an arm (drafter + tree shape) each step."""
