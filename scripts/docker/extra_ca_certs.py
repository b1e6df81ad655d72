"""Write the certificates of one PEM bundle that another lacks, one file each, so that
update-ca-certificates adds them: the local base image trusts what its host trusts (a host
whose HTTPS goes through an inspecting proxy has that proxy's CA in its bundle).

    python3 extra_ca_certs.py HOST_BUNDLE IMAGE_BUNDLE OUT_DIR    # prints how many it wrote
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PEM = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)


def certificates(path: Path) -> list[str]:
    return [" ".join(block.split()) for block in PEM.findall(path.read_text())]


def main(host_bundle: str, image_bundle: str, out_dir: str) -> int:
    known = set(certificates(Path(image_bundle)))
    extra = [pem for pem in certificates(Path(host_bundle)) if pem not in known]
    for index, pem in enumerate(extra):
        # Re-wrap the base64 body at 64 columns: the whitespace was folded for comparison.
        body = pem.removeprefix("-----BEGIN CERTIFICATE----- ").removesuffix(
            " -----END CERTIFICATE-----"
        )
        text = "".join(body.split())
        lines = [text[i : i + 64] for i in range(0, len(text), 64)]
        cert = "\n".join(["-----BEGIN CERTIFICATE-----", *lines, "-----END CERTIFICATE-----"])
        (Path(out_dir) / f"host-{index}.crt").write_text(cert + "\n")
    print(len(extra))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
