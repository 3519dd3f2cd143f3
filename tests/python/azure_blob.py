"""Azurite's containers through Microsoft's own client (azure-storage-blob), for the az://
tests: the emulator's well-known account at the blob endpoint given as the first argument.

    azure_blob.py ENDPOINT create CONTAINER
    azure_blob.py ENDPOINT upload-dir CONTAINER PREFIX DIR   # every file of DIR under PREFIX/
    azure_blob.py ENDPOINT list CONTAINER PREFIX              # one name per line
    azure_blob.py ENDPOINT get CONTAINER NAME                 # the blob's bytes to stdout
"""

import os
import sys

from azure.storage.blob import BlobServiceClient

# Azurite's documented development account; it guards nothing.
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def main(endpoint, command, container, *rest):
    connection = (
        f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={KEY};"
        f"BlobEndpoint={endpoint}/{ACCOUNT};"
    )
    service = BlobServiceClient.from_connection_string(connection)
    client = service.get_container_client(container)
    if command == "create":
        client.create_container()
    elif command == "upload-dir":
        prefix, folder = rest
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    client.upload_blob(f"{prefix}/{name}", f, overwrite=True)
    elif command == "list":
        (prefix,) = rest
        for blob in client.list_blobs(name_starts_with=prefix):
            print(blob.name)
    elif command == "get":
        (name,) = rest
        sys.stdout.buffer.write(client.download_blob(name).readall())
    else:
        sys.exit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
