"""What SDFT and SDPO share (TRL ships the same `loss_utils` and `teacher_sync` files in both packages; here they are
written once and re-exported by `trl.experimental.sdft` and `trl.experimental.sdpo`)."""
