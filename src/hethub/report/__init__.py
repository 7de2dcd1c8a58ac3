"""Output for people: tables for the terminal and Chrome traces for Perfetto."""
