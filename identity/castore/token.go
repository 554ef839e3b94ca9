package castore

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"time"

	bolt "go.etcd.io/bbolt"
)

// Bootstrap token lifetimes.
const (
	DefaultTokenTTL = time.Hour
	MaxTokenTTL     = 7 * 24 * time.Hour
)

// TokenPrefix starts every bootstrap token's secret (so that a leaked one
// is recognised by secret scanners and people).
const TokenPrefix = "ptb_"

// token is a bootstrap token as stored, under the SHA-256 of its secret.
type token struct {
	ID      string    `json:"id"`
	Grant   Grant     `json:"grant"`
	Created time.Time `json:"created"`
	Expires time.Time `json:"expires"`
	UsedAt  time.Time `json:"usedAt,omitzero"`
}

// CreateToken makes a single-use bootstrap token for g, valid for ttl (0:
// an hour; at most 7 days). g is checked now as Issue would check it.
// Only the SHA-256 of the secret is stored; id (the first 8 hex digits of
// that hash) names the token in the audit trail.
func (c *CA) CreateToken(g Grant, ttl time.Duration) (secret, id string, expires time.Time, err error) {
	if ttl == 0 {
		ttl = DefaultTokenTTL
	}
	if ttl < 0 || ttl > MaxTokenTTL {
		return "", "", time.Time{}, fmt.Errorf("%w: token lifetime %s: between a second and %s", ErrRefused, ttl, MaxTokenTTL)
	}
	if _, err := c.leafRequest(g); err != nil {
		return "", "", time.Time{}, c.refuse("token", g.Name, err)
	}
	var b [32]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", "", time.Time{}, err
	}
	secret = TokenPrefix + base64.RawURLEncoding.EncodeToString(b[:])
	hash := sha256.Sum256([]byte(secret))
	id = hex.EncodeToString(hash[:4])
	now := c.cfg.Now().UTC()
	t := token{ID: id, Grant: g, Created: now, Expires: now.Add(ttl)}
	v, err := json.Marshal(t)
	if err != nil {
		return "", "", time.Time{}, err
	}
	err = c.db.bolt.Update(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketTokens).Put(hash[:], v); err != nil {
			return err
		}
		return putAudit(tx, auditEvent{Time: now, Event: "token", By: "create", Name: g.Name, TokenID: id})
	})
	if err != nil {
		return "", "", time.Time{}, fmt.Errorf("castore: store the token: %w", err)
	}
	c.cfg.Logger.Info("audit", "event", "token", "action", "create", "token_id", id, "name", g.Name, "expires", t.Expires)
	return secret, id, t.Expires, nil
}

// RedeemToken uses a bootstrap token: it returns the token's grant and id
// and marks it used in the same transaction, so that it serves once. An
// unknown, used or expired token is ErrTokenInvalid.
func (c *CA) RedeemToken(secret string) (Grant, string, error) {
	hash := sha256.Sum256([]byte(strings.TrimSpace(secret)))
	now := c.cfg.Now().UTC()
	var t token
	why := ""
	err := c.db.bolt.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketTokens)
		v := b.Get(hash[:])
		if v == nil {
			why = "unknown"
			return ErrTokenInvalid
		}
		if err := json.Unmarshal(v, &t); err != nil {
			return fmt.Errorf("token: %w", err)
		}
		switch {
		case !t.UsedAt.IsZero():
			why = "already used at " + t.UsedAt.Format(time.RFC3339)
			return ErrTokenInvalid
		case !now.Before(t.Expires):
			why = "expired at " + t.Expires.Format(time.RFC3339)
			return ErrTokenInvalid
		}
		t.UsedAt = now
		v, err := json.Marshal(t)
		if err != nil {
			return err
		}
		if err := b.Put(hash[:], v); err != nil {
			return err
		}
		return putAudit(tx, auditEvent{Time: now, Event: "token", By: "redeem", Name: t.Grant.Name, TokenID: t.ID})
	})
	if err != nil {
		if why != "" {
			c.cfg.Logger.Info("audit", "event", "refuse", "by", "token", "token_id", t.ID, "reason", "bootstrap token "+why)
			_ = c.db.audit(auditEvent{Time: now, Event: "refuse", By: "token", TokenID: t.ID, Reason: "bootstrap token " + why})
		}
		return Grant{}, "", err
	}
	c.cfg.Logger.Info("audit", "event", "token", "action", "redeem", "token_id", t.ID, "name", t.Grant.Name)
	return t.Grant, t.ID, nil
}

// LookupToken returns the grant and ID of a bootstrap token that can still
// be used, without using it: the server checks a request against the
// token's grant first, so that a refused request does not burn the token.
// Unknown, used and expired tokens are ErrTokenInvalid, as RedeemToken
// answers them (RedeemToken decides: a token may be used in between).
func (c *CA) LookupToken(secret string) (Grant, string, error) {
	hash := sha256.Sum256([]byte(strings.TrimSpace(secret)))
	now := c.cfg.Now().UTC()
	var t token
	err := c.db.bolt.View(func(tx *bolt.Tx) error {
		v := tx.Bucket(bucketTokens).Get(hash[:])
		if v == nil {
			return ErrTokenInvalid
		}
		if err := json.Unmarshal(v, &t); err != nil {
			return fmt.Errorf("token: %w", err)
		}
		if !t.UsedAt.IsZero() || !now.Before(t.Expires) {
			return ErrTokenInvalid
		}
		return nil
	})
	if err != nil {
		return Grant{}, "", err
	}
	return t.Grant, t.ID, nil
}

// purgeTokens forgets tokens that expired more than a day before now.
func (d *DB) purgeTokens(now time.Time) error {
	return d.bolt.Update(func(tx *bolt.Tx) error {
		b := tx.Bucket(bucketTokens)
		var stale [][]byte
		err := b.ForEach(func(k, v []byte) error {
			var t token
			if json.Unmarshal(v, &t) != nil || now.Sub(t.Expires) > 24*time.Hour {
				stale = append(stale, k)
			}
			return nil
		})
		if err != nil {
			return err
		}
		for _, k := range stale {
			if err := b.Delete(k); err != nil {
				return err
			}
		}
		return nil
	})
}
