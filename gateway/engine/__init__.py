"""What the gateway knows about the engine: profiles, presets, flags, the final argv and environment, the status file.

The bottom floor of the engine side: the supervisor (which runs vLLM), the doctor (which checks what the
supervisor would start), the relay's monitor and the command line read it; it imports only settings.
"""
