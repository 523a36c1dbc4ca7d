"""age encryption of exported weights: ``save_weights_external(age_encryption_recipients=[…])``.

The tinker SDK lets the caller name age (filippo.io/age) recipients — native ``age1…`` X25519 keys or SSH public
keys, at most 10 — and then expects every exported file stored with a ``.age`` suffix, readable only with a matching
identity. tinker-cookbook's ``weights.download`` relies on it: it exports a training checkpoint encrypted to a key it
has just generated, and refuses any file of that export not named ``….age`` before decrypting it.

The recipients are the caller's input, so each is parsed before any work starts and a bad one is a user error that
names it. The files are encrypted in the export's staging directory, each plaintext deleted as soon as its ciphertext
is written, before the directory is published: no unencrypted copy ever gets a download URL.
"""

from __future__ import annotations

from pathlib import Path

import pyrage

from shims.errors import UserError

AGE_SUFFIX = ".age"

MAX_RECIPIENTS = 10
"""The most recipients one export may name: the limit the SDK documents (``TrainingClient.save_weights_external``)."""

MAX_RECIPIENT_CHARS = 4096
"""Room for any key age reads: an X25519 key is 62 characters, an SSH public key about 80 (ssh-ed25519) to 1,400
(ssh-rsa, 8192 bits) plus its comment."""

_HINT = ("give an age X25519 public key (age1…, as age-keygen prints it) or an SSH public key (ssh-ed25519 … or "
         "ssh-rsa …)")


def parse_recipients(values: list[str]) -> list:
    """The recipients as pyrage objects; a list that is empty, too long, or holds a malformed key is a user error."""
    if not values:
        raise UserError("age_encryption_recipients is empty: name at least one recipient, or leave it unset to export "
                        "unencrypted")
    if len(values) > MAX_RECIPIENTS:
        raise UserError(f"age_encryption_recipients names {len(values)} recipients; at most {MAX_RECIPIENTS} are "
                        "allowed")
    recipients = []
    for index, value in enumerate(values):
        if len(value) > MAX_RECIPIENT_CHARS:
            raise UserError(f"age_encryption_recipients[{index}] is {len(value)} characters long, more than any age "
                            f"recipient (at most {MAX_RECIPIENT_CHARS}); {_HINT}")
        kind = pyrage.ssh.Recipient if value.startswith("ssh-") else pyrage.x25519.Recipient
        try:
            recipients.append(kind.from_str(value))
        except pyrage.RecipientError as exc:
            raise UserError(f"age_encryption_recipients[{index}] is not a valid age recipient ({exc}); {_HINT}") \
                from None
    return recipients


def encrypt_directory(directory: Path, recipients: list) -> None:
    """Replace every file under ``directory`` by ``<name>.age``, encrypted to all ``recipients``."""
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        pyrage.encrypt_file(str(file), str(file.with_name(file.name + AGE_SUFFIX)), recipients)
        file.unlink()
