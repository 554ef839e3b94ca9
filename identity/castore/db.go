package castore

import (
	"bytes"
	"crypto/x509"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math/big"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"

	"pilab.hu/pivirt-agent/identity"
)

// Buckets and meta keys of the database.
var (
	bucketCerts  = []byte("certs")  // serial (uppercase hex) → Record (JSON)
	bucketNames  = []byte("names")  // CN \x00 serial → nothing
	bucketTokens = []byte("tokens") // SHA-256 of the secret → token (JSON)
	bucketMeta   = []byte("meta")   // metaSchema, metaExternalURL, metaCRLNumber
	bucketAudit  = []byte("audit")  // sequence (8 bytes, big-endian) → auditEvent (JSON)

	metaSchema      = []byte("schema_version")
	metaExternalURL = []byte("external_url")
	metaCRLNumber   = []byte("crl_number")
)

// schemaVersion is the layout of the database this package writes.
const schemaVersion = 1

// auditKeep is how many audit events the database keeps (the oldest go).
const auditKeep = 10000

// Certificate statuses of a Record.
const (
	StatusValid   = "valid"
	StatusRevoked = "revoked"
	StatusExpired = "expired"
)

// IssuedByOffline is the IssuedBy of certificates that `pitrust issue-*
// --db` records.
const IssuedByOffline = "pitrust (offline)"

// DB is the certificate inventory, the bootstrap tokens, the audit trail
// and the CA server's metadata, in one bbolt file. A CA uses one; the
// offline `pitrust` commands open it with OpenDB when no server runs.
type DB struct {
	bolt *bolt.DB
	path string
}

// OpenDB opens the database at path, creating it (0600, its directory
// 0700) when missing. A database held by another process (a running
// `pitrust serve`) is refused with ErrLocked after a second.
func OpenDB(path string) (*DB, error) {
	if path == "" {
		return nil, errors.New("castore: no database path")
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("castore: database directory: %w", err)
	}
	b, err := bolt.Open(path, 0o600, &bolt.Options{Timeout: time.Second})
	if errors.Is(err, bolterrors.ErrTimeout) {
		return nil, fmt.Errorf("%w: %s is held by another process, a running `pitrust serve`: use --server to ask it, or stop it", ErrLocked, path)
	}
	if err != nil {
		return nil, fmt.Errorf("castore: open %s: %w", path, err)
	}
	d := &DB{bolt: b, path: path}
	err = b.Update(func(tx *bolt.Tx) error {
		for _, name := range [][]byte{bucketCerts, bucketNames, bucketTokens, bucketMeta, bucketAudit} {
			if _, err := tx.CreateBucketIfNotExists(name); err != nil {
				return err
			}
		}
		meta := tx.Bucket(bucketMeta)
		if v := meta.Get(metaSchema); v != nil {
			n, err := strconv.Atoi(string(v))
			if err != nil || n > schemaVersion {
				return fmt.Errorf("schema version %q: this pitrust knows version %d at most (a newer pitrust wrote it?)", v, schemaVersion)
			}
			return nil
		}
		return meta.Put(metaSchema, []byte(strconv.Itoa(schemaVersion)))
	})
	if err != nil {
		b.Close()
		return nil, fmt.Errorf("castore: %s: %w", path, err)
	}
	return d, nil
}

// Close closes the database.
func (d *DB) Close() error {
	return d.bolt.Close()
}

// ExternalURL is the external URL the last `pitrust serve` recorded (""
// if none): the base of the OCSP and CRL URLs its certificates carry.
func (d *DB) ExternalURL() string {
	var u string
	_ = d.bolt.View(func(tx *bolt.Tx) error {
		u = string(tx.Bucket(bucketMeta).Get(metaExternalURL))
		return nil
	})
	return u
}

func (d *DB) setExternalURL(u string) error {
	return d.bolt.Update(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketMeta).Put(metaExternalURL, []byte(u))
	})
}

// Record adds cert to the inventory as issued by issuedBy (an operator,
// a token, IssuedByOffline), with an audit event.
func (d *DB) Record(cert *x509.Certificate, issuedBy string) error {
	rec := recordOf(cert, issuedBy)
	return d.bolt.Update(func(tx *bolt.Tx) error {
		if err := putRecord(tx, rec); err != nil {
			return err
		}
		return putAudit(tx, auditEvent{Event: "issue", By: issuedBy, Name: rec.Name, DNS: rec.DNSNames, IPs: rec.IPs, Serial: rec.Serial})
	})
}

// Revoke marks as revoked, for reason (an RFC 5280 reason name; ""
// means unspecified), the certificate with that serial (hex, colons and
// lower case accepted) or every valid certificate whose CN is name, and
// returns the records revoked. A serial already revoked answers its
// record as it is; a name's revoked and expired certificates are skipped.
// An unknown serial or name is ErrNotFound. The server rebuilds its CRL
// from the database when it starts.
func (d *DB) Revoke(serial, name, reason string, now time.Time) ([]Record, error) {
	return d.revoke(serial, name, reason, now, "pitrust (offline)")
}

func (d *DB) revoke(serial, name, reason string, now time.Time, by string) ([]Record, error) {
	if reason == "" {
		reason = "unspecified"
	}
	code, err := ParseRevocationReason(reason)
	if err != nil {
		return nil, err
	}
	reason = RevocationReasonName(code)
	if (serial == "") == (name == "") {
		return nil, fmt.Errorf("%w: give a serial or a name to revoke, not both nor neither", ErrRefused)
	}
	var out []Record
	err = d.bolt.Update(func(tx *bolt.Tx) error {
		var serials []string
		if serial != "" {
			s, err := NormalizeSerial(serial)
			if err != nil {
				return err
			}
			serials = []string{s}
		} else {
			serials = namesSerials(tx, name)
			if len(serials) == 0 {
				return fmt.Errorf("%w: no certificate with the name %q", ErrNotFound, name)
			}
		}
		for i := 0; i < len(serials); i++ {
			s := serials[i]
			rec, err := getRecord(tx, s)
			if err != nil {
				return err
			}
			if serial != "" {
				// Renewals of a revoked certificate go with it: whoever held
				// its key may have renewed it first. So do the certificates
				// it renewed (a lineage: whoever held the new key may have
				// held the old one).
				kids, err := renewalsOf(tx, s)
				if err != nil {
					return err
				}
				for _, k := range kids {
					if !slices.Contains(serials, k) {
						serials = append(serials, k)
					}
				}
				if parent, ok := strings.CutPrefix(rec.IssuedBy, "renewal of "); ok {
					if p, err := NormalizeSerial(parent); err == nil && !slices.Contains(serials, p) {
						if _, err := getRecord(tx, p); err == nil {
							serials = append(serials, p)
						}
					}
				}
			}
			if rec.Status == StatusRevoked {
				if serial != "" && i == 0 {
					out = append(out, rec.at(now))
				}
				continue
			}
			if (serial == "" || i > 0) && rec.StatusAt(now) != StatusValid {
				continue
			}
			rec.Status, rec.RevokedAt, rec.Reason = StatusRevoked, now.UTC(), reason
			if err := putRecord(tx, rec); err != nil {
				return err
			}
			if err := putAudit(tx, auditEvent{Event: "revoke", By: by, Name: rec.Name, Serial: rec.Serial, Reason: reason}); err != nil {
				return err
			}
			out = append(out, rec.at(now))
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// renewalsOf returns the serials of the certificates renewed from serial.
// renewals returns the records of the renewals of serial.
func (d *DB) renewals(serial string) ([]Record, error) {
	var out []Record
	err := d.bolt.View(func(tx *bolt.Tx) error {
		kids, err := renewalsOf(tx, serial)
		if err != nil {
			return err
		}
		for _, k := range kids {
			rec, err := getRecord(tx, k)
			if err != nil {
				return err
			}
			out = append(out, rec)
		}
		return nil
	})
	return out, err
}

func renewalsOf(tx *bolt.Tx, serial string) ([]string, error) {
	var out []string
	by := "renewal of " + serial
	err := tx.Bucket(bucketCerts).ForEach(func(k, v []byte) error {
		var rec Record
		if err := json.Unmarshal(v, &rec); err != nil {
			return fmt.Errorf("record: %w", err)
		}
		if rec.IssuedBy == by {
			out = append(out, rec.Serial)
		}
		return nil
	})
	return out, err
}

// List returns the records with that status ("" or "all": any; valid,
// revoked, expired at now) and CN ("" any), newest first.
func (d *DB) List(status, name string, now time.Time) ([]Record, error) {
	switch status {
	case "", "all", StatusValid, StatusRevoked, StatusExpired:
	default:
		return nil, fmt.Errorf("%w: status %q: want valid, revoked, expired or all", ErrRefused, status)
	}
	var out []Record
	err := d.bolt.View(func(tx *bolt.Tx) error {
		visit := func(rec Record) {
			rec = rec.at(now)
			if status != "" && status != "all" && rec.Status != status {
				return
			}
			out = append(out, rec)
		}
		if name != "" {
			for _, s := range namesSerials(tx, name) {
				rec, err := getRecord(tx, s)
				if err != nil {
					return err
				}
				visit(rec)
			}
			return nil
		}
		return tx.Bucket(bucketCerts).ForEach(func(_, v []byte) error {
			var rec Record
			if err := json.Unmarshal(v, &rec); err != nil {
				return fmt.Errorf("record: %w", err)
			}
			visit(rec)
			return nil
		})
	})
	if err != nil {
		return nil, err
	}
	slices.SortFunc(out, func(a, b Record) int {
		if c := b.NotBefore.Compare(a.NotBefore); c != 0 {
			return c
		}
		return strings.Compare(b.Serial, a.Serial)
	})
	return out, nil
}

// get returns the record of a serial (any spelling NormalizeSerial takes).
func (d *DB) get(serial string, now time.Time) (Record, error) {
	s, err := NormalizeSerial(serial)
	if err != nil {
		return Record{}, err
	}
	var rec Record
	err = d.bolt.View(func(tx *bolt.Tx) error {
		rec, err = getRecord(tx, s)
		return err
	})
	if err != nil {
		return Record{}, err
	}
	return rec.at(now), nil
}

// revoked lists the revoked records that have not expired at now (what
// a CRL carries) and takes the next CRL number.
func (d *DB) revokedForCRL(now time.Time) ([]Record, *big.Int, error) {
	var recs []Record
	number := new(big.Int)
	err := d.bolt.Update(func(tx *bolt.Tx) error {
		err := tx.Bucket(bucketCerts).ForEach(func(_, v []byte) error {
			var rec Record
			if err := json.Unmarshal(v, &rec); err != nil {
				return fmt.Errorf("record: %w", err)
			}
			if rec.Status == StatusRevoked && now.Before(rec.NotAfter) {
				recs = append(recs, rec)
			}
			return nil
		})
		if err != nil {
			return err
		}
		meta := tx.Bucket(bucketMeta)
		if v := meta.Get(metaCRLNumber); v != nil {
			number.SetBytes(v)
		}
		number.Add(number, big.NewInt(1))
		return meta.Put(metaCRLNumber, number.Bytes())
	})
	return recs, number, err
}

// audit records an event outside of another change (a refusal).
func (d *DB) audit(ev auditEvent) error {
	return d.bolt.Update(func(tx *bolt.Tx) error { return putAudit(tx, ev) })
}

// auditEvent is one entry of the audit bucket (and of the audit log).
type auditEvent struct {
	Time    time.Time `json:"time"`
	Event   string    `json:"event"` // issue, refuse, revoke, renew, token
	By      string    `json:"by,omitempty"`
	Name    string    `json:"name,omitempty"`
	DNS     []string  `json:"dns,omitempty"`
	IPs     []string  `json:"ips,omitempty"`
	Serial  string    `json:"serial,omitempty"`
	Reason  string    `json:"reason,omitempty"`
	TokenID string    `json:"tokenId,omitempty"`
}

// AuditEvents returns the audit events the database keeps (the last
// 10000), oldest first, as JSON objects.
func (d *DB) AuditEvents() ([]json.RawMessage, error) {
	var out []json.RawMessage
	err := d.bolt.View(func(tx *bolt.Tx) error {
		return tx.Bucket(bucketAudit).ForEach(func(_, v []byte) error {
			out = append(out, json.RawMessage(bytes.Clone(v)))
			return nil
		})
	})
	return out, err
}

func putAudit(tx *bolt.Tx, ev auditEvent) error {
	if ev.Time.IsZero() {
		ev.Time = time.Now().UTC()
	}
	b := tx.Bucket(bucketAudit)
	seq, err := b.NextSequence()
	if err != nil {
		return err
	}
	v, err := json.Marshal(ev)
	if err != nil {
		return err
	}
	if err := b.Put(seqKey(seq), v); err != nil {
		return err
	}
	if seq > auditKeep {
		return b.Delete(seqKey(seq - auditKeep))
	}
	return nil
}

func seqKey(n uint64) []byte {
	return binary.BigEndian.AppendUint64(nil, n)
}

func putRecord(tx *bolt.Tx, rec Record) error {
	v, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	if err := tx.Bucket(bucketCerts).Put([]byte(rec.Serial), v); err != nil {
		return err
	}
	return tx.Bucket(bucketNames).Put(nameKey(rec.Name, rec.Serial), nil)
}

func getRecord(tx *bolt.Tx, serial string) (Record, error) {
	v := tx.Bucket(bucketCerts).Get([]byte(serial))
	if v == nil {
		return Record{}, fmt.Errorf("%w: no certificate with the serial %s", ErrNotFound, serial)
	}
	var rec Record
	if err := json.Unmarshal(v, &rec); err != nil {
		return Record{}, fmt.Errorf("record %s: %w", serial, err)
	}
	return rec, nil
}

func nameKey(name, serial string) []byte {
	return []byte(name + "\x00" + serial)
}

// namesSerials lists the serials recorded for the CN name.
func namesSerials(tx *bolt.Tx, name string) []string {
	prefix := []byte(name + "\x00")
	var out []string
	c := tx.Bucket(bucketNames).Cursor()
	for k, _ := c.Seek(prefix); k != nil && bytes.HasPrefix(k, prefix); k, _ = c.Next() {
		out = append(out, string(k[len(prefix):]))
	}
	return out
}

// NormalizeSerial turns a serial as an operator may type it (hex, with
// or without colons, any case) into the spelling of Record.Serial:
// uppercase hex of the integer's bytes, as `openssl x509 -serial` prints.
func NormalizeSerial(s string) (string, error) {
	clean := strings.ReplaceAll(strings.TrimSpace(s), ":", "")
	n, ok := new(big.Int).SetString(clean, 16)
	if !ok || n.Sign() < 0 || clean == "" {
		return "", fmt.Errorf("%w: serial %q: want the certificate's serial in hex (as `openssl x509 -serial` prints it)", ErrRefused, s)
	}
	return serialString(n), nil
}

// serialString is the Record spelling of a serial number.
func serialString(n *big.Int) string {
	b := n.Bytes()
	if len(b) == 0 {
		b = []byte{0}
	}
	return strings.ToUpper(hex.EncodeToString(b))
}

// recordOf describes cert for the inventory.
func recordOf(cert *x509.Certificate, issuedBy string) Record {
	rec := Record{
		Serial:    serialString(cert.SerialNumber),
		Subject:   cert.Subject.String(),
		Name:      cert.Subject.CommonName,
		DNSNames:  slices.Clone(cert.DNSNames),
		NotBefore: cert.NotBefore.UTC(),
		NotAfter:  cert.NotAfter.UTC(),
		Status:    StatusValid,
		IssuedBy:  issuedBy,
		CertPEM:   pemCert(cert.Raw),
	}
	for _, ip := range cert.IPAddresses {
		rec.IPs = append(rec.IPs, ip.String())
	}
	for _, u := range cert.ExtKeyUsage {
		switch u {
		case x509.ExtKeyUsageServerAuth:
			rec.Usages = append(rec.Usages, identity.UsageServer)
		case x509.ExtKeyUsageClientAuth:
			rec.Usages = append(rec.Usages, identity.UsageClient)
		}
	}
	for _, ou := range cert.Subject.OrganizationalUnit {
		if k := identity.Kind(ou); k == identity.KindServer || k == identity.KindClient {
			rec.Kind = k
		}
	}
	if rec.Kind == "" && len(rec.Usages) > 0 {
		rec.Kind = identity.KindServer
		if rec.Usages[0] == identity.UsageClient {
			rec.Kind = identity.KindClient
		}
	}
	return rec
}
