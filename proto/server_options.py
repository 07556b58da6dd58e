"""gRPC channel/server options shared by every Tandem server and client."""

# Prompts of max_model_len token ids and long streams fit well below these.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),
]
