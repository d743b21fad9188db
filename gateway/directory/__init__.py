"""The shared session directory of several gateways (issue 20, docs/deploy.md "Scale-out").

One Redis holds, for each live session, which gateway owns it (its address) and which Triton replica holds its
KV; each gateway holds a lease key that it refreshes while it runs. A resume that reaches a gateway which does
not own the session is relayed, frame for frame, to the owner (`relay.py`), which runs the whole resume
procedure itself: the replay is the owner's journal bytes, the old token is refused by the owner, exactly as on
one gateway. A session whose owner's lease has run out (the gateway died) is gone: a resume gets
`session_resume_expired` (before that, `runtime_resume_failed`: the owner does not answer), and one gateway's
sweep (`sweep.py`) closes its Triton sequence and forgets it.
"""
