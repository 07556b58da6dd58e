"""gRPC channel/server options shared by every Tandem server and client."""

# Prompts of max_model_len token ids and long streams fit well below these.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]

# Calls a server holds that its (Python) handlers have not taken up yet. gRPC's default
# (1,000, hard limit 3,000) cancels the rest: one completion of 128 prompts x n = 16 sends
# 2,048 Decode calls to a decode worker at once, and ~240 of them ended CANCELLED (the
# router then took the worker for dead and answered 503). A pending call costs a few KB.
MAX_PENDING_CALLS = 65536

SERVER_OPTIONS = [
    *GRPC_OPTIONS,
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
]
