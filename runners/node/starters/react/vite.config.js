import { defineConfig } from 'vite'
import react from '@vitejs/plugin-react'

// base './': the built site works under any URL prefix (the broker serves
// it at /preview/<id>/).
export default defineConfig({
  plugins: [react()],
  base: './',
})
