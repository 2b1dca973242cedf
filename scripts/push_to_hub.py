#!/usr/bin/env python
"""Upload a trained checkpoint directory (weights, tokenizer, module files, model card) to the Hugging Face Hub.

    python scripts/push_to_hub.py --model_dir outputs/en-fr --repo_id your-name/vaswani-en-fr [--private]

The token defaults to the one saved by `hf auth login` (or $HF_TOKEN).
"""

import argparse

from huggingface_hub.errors import HfHubHTTPError, HTTPError

from vaswani.cli import user_errors_exit
from vaswani.hub import push_to_hub


@user_errors_exit
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_dir", required=True, help="checkpoint directory written by the training script")
    parser.add_argument("--repo_id", required=True, help="namespace/name of the model repository")
    parser.add_argument("--token", default=None, help="Hub token with write access (default: the saved login)")
    parser.add_argument("--private", action="store_true", help="create the repository as private")
    args = parser.parse_args(argv)
    try:
        commit_url = push_to_hub(args.model_dir, args.repo_id, token=args.token, private=args.private)
    except HfHubHTTPError as error:
        # A rejected token or a missing write permission is the user's to fix: report the Hub's first line (what
        # failed) as a user error rather than a traceback.
        raise ValueError(str(error).splitlines()[0]) from error
    except HTTPError as error:  # no answer from the Hub: the connection failed or dropped
        raise ValueError(f"The connection to the Hub failed ({error}); a push is one commit, applied whole or not at "
                         "all, so the repository holds its previous revision. Run the push again.") from error
    print(commit_url)


if __name__ == "__main__":
    main()
