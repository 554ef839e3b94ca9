package main

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	clusterv1 "pilab.hu/pivirt-agent/proto/pivirt/cluster/v1"
	"pilab.hu/pivirt-agent/proto/pivirt/cluster/v1/clusterv1connect"
)

func (a *app) newKeyringCmd() *cobra.Command {
	op := func(use, short string, op clusterv1.KeyringOp) *cobra.Command {
		args := positional()
		if op != clusterv1.KeyringOp_KEYRING_OP_LIST {
			args = positional("KEY")
		}
		return &cobra.Command{
			Use:   use,
			Short: short,
			Args:  args,
			RunE: a.command(func(cmd *cobra.Command, args []string) error {
				key := ""
				if len(args) > 0 {
					key = args[0]
				}
				return a.keyring(cmd, op, key)
			}),
		}
	}
	return groupCmd("keyring", "Rotate the gossip encryption key on every member: install, use, remove",
		op("list", "List each member's gossip keys (by fingerprint) and the one in use", clusterv1.KeyringOp_KEYRING_OP_LIST),
		op("install KEY", "Install a base64 key on every member (it decrypts from now on)", clusterv1.KeyringOp_KEYRING_OP_INSTALL),
		op("use KEY|FINGERPRINT", "Make an installed key (the key, or its fingerprint as list shows it) the one every member encrypts with", clusterv1.KeyringOp_KEYRING_OP_USE),
		op("remove KEY|FINGERPRINT", "Remove a key that is no longer in use (the key, or its fingerprint as list shows it) from every member", clusterv1.KeyringOp_KEYRING_OP_REMOVE),
		&cobra.Command{
			Use:   "generate",
			Short: "Print a new random 32-byte key, base64 (offline)",
			Args:  positional(),
			RunE: a.command(func(*cobra.Command, []string) error {
				var b [32]byte
				_, _ = rand.Read(b[:])
				_, err := fmt.Fprintln(a.stdout, base64.StdEncoding.EncodeToString(b[:]))
				return err
			}),
		},
	)
}

// errKeyringFailed: the operation failed on some members.
var errKeyringFailed = errors.New("the keyring operation failed on some members")

func (a *app) keyring(cmd *cobra.Command, op clusterv1.KeyringOp, key string) error {
	return a.call(cmd, func(ctx context.Context, api clusterv1connect.ClusterServiceClient) error {
		resp, err := api.Keyring(ctx, connect.NewRequest(&clusterv1.KeyringRequest{Op: op, Key: strings.TrimSpace(key)}))
		if err != nil {
			return err
		}
		var failed []string
		for _, n := range resp.Msg.GetNodes() {
			if n.GetError() != "" {
				failed = append(failed, n.GetNode())
			}
		}
		if err := a.render(resp.Msg, func(w io.Writer) {
			row(w, "NODE", "PRIMARY", "KEYS", "ERROR")
			for _, n := range resp.Msg.GetNodes() {
				row(w, n.GetNode(), n.GetPrimary(), strings.Join(n.GetKeys(), ","), n.GetError())
			}
		}); err != nil {
			return err
		}
		if len(failed) > 0 {
			return fmt.Errorf("%w: %s (repeat it once they are reachable)", errKeyringFailed, strings.Join(failed, ", "))
		}
		return nil
	})
}
